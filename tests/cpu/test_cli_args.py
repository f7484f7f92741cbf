"""Bad `megamoe-rt` arguments: exit status 2 and one line naming the argument, before any GPU work.

Every command runs in-process through its entry function; the GPU probe is replaced by one
that fails the test, so a check that comes too late shows up as that failure.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

import megamoe_rt.cli.commands as commands
import megamoe_rt.cli.main as cli
from megamoe_rt.presets import get_preset
from megamoe_rt.schedule.plan import max_tokens_per_rank as plan_token_limit

H200 = SimpleNamespace(ordinal=0, name="NVIDIA H200", sm_count=132)


def _gpu_probed(*args, **kwargs):
    raise AssertionError("the GPU was probed before the arguments were checked")


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(commands, "hopper_or_none", _gpu_probed)


def usage_line(capsys, status: int) -> str:
    """The one stderr line of a usage error (exit status 2)."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# --- plan -------------------------------------------------------------------------------------


def test_plan_tokens_past_the_32_bit_pool_rows_are_a_usage_error(capsys):
    line = usage_line(capsys, cli.main(["plan", "--tokens", "99999999999"]))
    assert "--tokens 99999999999" in line and "32-bit" in line


def test_plan_takes_tokens_up_to_the_limit_it_names(capsys):
    flash = get_preset("flash")
    limit = plan_token_limit(8, flash.num_topk, flash.num_experts // 8, 128)
    assert limit > 0 and limit % 128 == 0
    assert cli.main(["plan", "--tokens", str(limit), "--json"]) == 0
    capsys.readouterr()
    line = usage_line(capsys, cli.main(["plan", "--tokens", str(limit + 1)]))
    assert f"at most {limit} tokens" in line and "--tokens" in line


@pytest.mark.parametrize("mode", ["fused", "split"])  # split runs the fused kernel's block tables
def test_plan_of_the_fused_kernels_modes_stops_at_their_pool_blocks(capsys, mode):
    flash = get_preset("flash")
    limit = plan_token_limit(8, flash.num_topk, flash.num_experts // 8, 64, 2**24 * 64)
    assert cli.main(["plan", "--mode", mode, "--tokens", str(limit), "--json"]) == 0
    capsys.readouterr()
    line = usage_line(capsys, cli.main(["plan", "--mode", mode, "--tokens", str(limit + 1)]))
    assert "--tokens" in line and "fused kernel" in line


@pytest.mark.parametrize("experts", ["2147483648", "99999999992"])
def test_plan_experts_that_overflow_the_workspace_are_a_usage_error(capsys, experts):
    line = usage_line(capsys, cli.main(["plan", "--experts", experts]))
    assert f"--experts {experts}" in line


# --- scaleout ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--link-gbps", "0"),
        ("--link-gbps", "-5"),
        ("--link-gbps", "nan"),
        ("--link-gbps", "inf"),
        ("--tflops", "0"),
        ("--tflops", "inf"),
        ("--tflops", "nan"),
    ],
)
def test_scaleout_rates_must_be_positive_finite_numbers(capsys, flag, value):
    line = usage_line(capsys, cli.main(["scaleout", flag, value]))
    assert flag in line and "positive finite number" in line


def test_scaleout_says_a_scale_out_needs_two_ranks(capsys):
    line = usage_line(capsys, cli.main(["scaleout", "--ranks", "1"]))
    assert "--ranks 1" in line and "at least 2 ranks" in line and "divide" not in line


# --- tune-split -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, value",
    [("--step", "0"), ("--step", "-8"), ("--tokens", "0"), ("--tokens", "-5"), ("--ranks", "0"), ("--ranks", "-2")],
)
def test_tune_split_counts_must_be_positive_before_the_gpu_probe(capsys, no_gpu, flag, value):
    argv = ["tune-split", "--tokens", "64", flag, value]
    line = usage_line(capsys, cli.main(argv))
    assert flag in line and "positive integer" in line


def test_tune_split_module_entry_refuses_bad_counts_in_one_line(capsys):
    from megamoe_rt.cli import tune_split

    line = usage_line(capsys, tune_split.main(["--tokens", "64", "--step", "0"]))
    assert "--step" in line


def test_tune_split_step_that_leaves_no_split_is_refused_with_the_largest_that_works():
    from megamoe_rt.cli.tune_split import split_candidates
    from megamoe_rt.cli.usage import UsageError

    assert len(split_candidates(132, 8, None)) == 10
    assert [s.l1 for s in split_candidates(132, 8, 104)] == [112]
    with pytest.raises(
        UsageError, match=r"--step 1000 leaves no K1 count.*132-SM.*largest step that leaves one is 104"
    ):
        split_candidates(132, 8, 1000)


def test_tune_split_step_is_checked_before_anything_is_timed(monkeypatch, capsys):
    import megamoe_rt.graph.green as green
    import megamoe_rt.layer as layer
    from megamoe_rt.runtime import devices

    fake_cupy = SimpleNamespace(cuda=SimpleNamespace(Device=lambda d: SimpleNamespace(use=lambda: None)))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    import megamoe_rt.requirements as requirements

    monkeypatch.setattr(commands, "hopper_or_none", lambda command: H200)
    monkeypatch.setattr(requirements, "gpu_or_report", lambda program, ordinal=None: H200)  # CuPy is stood in for
    monkeypatch.setattr(devices, "require_hopper", lambda device=None: H200)
    monkeypatch.setattr(green, "partition_granularity", lambda device, fine=False: 8)
    monkeypatch.setattr(layer, "MegaMoE", _gpu_probed)
    import megamoe_rt.cli.tune_split as tune_split

    monkeypatch.setattr(tune_split, "rank_inputs", _gpu_probed)
    status = cli.main(["tune-split", "--tokens", "64", "--step", "1000", "--no-store"])
    line = usage_line(capsys, status)
    assert line.startswith("megamoe-rt tune-split: --step 1000 leaves no K1 count")


# --- trace ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, flag",
    [(["--preset", "nope"], "--preset"), (["--tokens", "-5"], "--tokens"), (["--tokens", "0"], "--tokens")],
)
def test_trace_arguments_are_checked_before_the_gpu_probe(capsys, no_gpu, argv, flag):
    line = usage_line(capsys, cli.main(["trace", *argv]))
    assert flag in line


def test_trace_module_entry_refuses_bad_arguments_in_one_line(capsys):
    from megamoe_rt.cli import trace

    line = usage_line(capsys, trace.main(["--preset", "nope"]))
    assert "--preset" in line and "nope" in line


# --- bench ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, words",
    [
        (["moe", "--capacity", "-5"], ("--capacity", "positive integer")),
        (["moe", "--capacity", "0"], ("--capacity", "positive integer")),
        (["moe", "--capacity", "100", "--tokens", "64,256"], ("--capacity 100", "largest --tokens value 256")),
        (["moe", "--capacity", "4096"], ("--capacity 4096", "largest --tokens value 8192")),  # the default tokens
        (["gemm", "--capacity", "9000"], ("--capacity", "bench moe only")),
    ],
)
def test_bench_capacity_is_checked_before_the_gpu_probe(capsys, no_gpu, argv, words):
    line = usage_line(capsys, cli.main(["bench", *argv]))
    assert all(w in line for w in words), line


def test_bench_moe_takes_a_capacity_of_at_least_the_largest_tokens(monkeypatch, capsys):
    import megamoe_rt.cli.benchmarks as benchmarks

    seen = {}
    monkeypatch.setattr(commands, "hopper_or_none", lambda command: H200)
    monkeypatch.setattr(benchmarks, "bench_moe", lambda presets, tokens, **kw: seen.update(kw, tokens=tokens))
    line = usage_line(capsys, cli.main(["bench", "moe", "--tokens", "64,256", "--capacity", "255"]))
    assert "--capacity 255" in line and not seen
    assert cli.main(["bench", "moe", "--tokens", "64,256", "--capacity", "256"]) == 0
    assert (seen["tokens"], seen["capacity"]) == ([64, 256], 256)


def test_bench_moe_refuses_a_capacity_below_its_tokens_before_any_gpu_work():
    from megamoe_rt.cli.benchmarks import bench_moe

    with pytest.raises(ValueError, match="capacity=100"):
        bench_moe(["flash"], [64, 256], capacity=100)


# --- benchmarks across ranks ------------------------------------------------------------------


@pytest.mark.parametrize(
    "what, argv, flag",
    [
        ("moe", ["--tokens", "-5"], "--tokens"),
        ("moe", ["--tokens", "0"], "--tokens"),
        ("overhead", ["--tokens", "64,-1"], "--tokens"),
        ("stream", ["--tokens", "x"], "--tokens"),
        ("moe", ["--rounds", "0"], "--rounds"),
        ("moe", ["--preset", "nope"], "--preset"),
        ("moe", ["--mode", "bogus"], "--mode"),
        ("moe", ["--mode", "unfused@carrier-pigeon"], "--mode"),
        ("prefill", ["--mode", "fused@nvshmem"], "--mode"),  # a transport only moe takes
        ("prefill", ["--ratios", "2"], "--ratios"),
        ("prefill", ["--ratios", "nan"], "--ratios"),
    ],
)
def test_benchmarks_across_ranks_refuse_bad_options_in_one_line(capsys, what, argv, flag):
    from megamoe_rt.cli.bench_ep import ep_arguments

    with pytest.raises(SystemExit) as exit_:
        ep_arguments(argv, what)
    line = usage_line(capsys, exit_.value.code)
    assert flag in line


def test_benchmarks_across_ranks_take_a_forced_transport_only_for_moe(capsys):
    from megamoe_rt.cli.bench_ep import ep_arguments

    a = ep_arguments(["--mode", "unfused@nvshmem,fused", "--tokens", "64,128", "--rounds", "2"], "moe")
    assert (a.mode, a.tokens, a.rounds) == (["unfused@nvshmem", "fused"], [64, 128], 2)
    with pytest.raises(SystemExit) as exit_:
        ep_arguments(["--mode", "unfused@nvshmem"], "overhead")
    assert "--mode" in usage_line(capsys, exit_.value.code)


def test_a_launched_rank_refuses_bad_tokens_before_joining_its_group(monkeypatch, capsys):
    import megamoe_rt.ep.launch as launch
    from megamoe_rt.cli.bench_ep import main_ep

    monkeypatch.setattr(launch, "context_from_env", _gpu_probed)
    with pytest.raises(SystemExit) as exit_:
        main_ep(["--tokens", "-5"], "moe")
    assert "--tokens" in usage_line(capsys, exit_.value.code)


# --- faults -----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["-5", "0", "nan", "inf"])
def test_the_fault_suite_limit_must_be_positive_seconds(monkeypatch, capsys, value):
    from megamoe_rt.cli import faults

    monkeypatch.setattr(faults, "run_fault", _gpu_probed)
    with pytest.raises(SystemExit) as exit_:
        faults.main(["--limit", value])
    assert exit_.value.code == 2
    assert "--limit" in capsys.readouterr().err
