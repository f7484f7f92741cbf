"""Partition arithmetic and pipeline specs (CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megamoe_rt.graph import SpecError, load_spec, parse_spec, plan_partitions, valid_counts

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"


@pytest.mark.parametrize(
    "requests,expected,remainder",
    [
        ([("a", 64), ("b", 64)], [("a", 64), ("b", 64)], 4),
        ([("a", 64), ("b", "rest")], [("a", 64), ("b", 68)], 0),  # the rest is every SM left
        ([("k1", 96), ("k2", 32)], [("k1", 96), ("k2", 32)], 4),
        ([("k1", 96), ("k2", "rest")], [("k1", 96), ("k2", 36)], 0),
        ([("a", 8), ("b", "rest")], [("a", 8), ("b", 124)], 0),
        ([("x", 128)], [("x", 128)], 4),
        ([("a", 40), ("b", 48), ("c", "rest")], [("a", 40), ("b", 48), ("c", 44)], 0),
        ([("a", "rest"), ("b", 16)], [("a", 116), ("b", 16)], 0),
    ],
)
def test_splits_of_132_sms_in_units_of_8(requests, expected, remainder):
    # What an H200 allows (bench/results/green_splits_h200_2026-12-01.md): any multiple of 8
    # split off the device, the remainder split again, the rest taking every SM left.
    plan = plan_partitions(132, 8, requests)
    assert list(plan.sizes) == expected and plan.remainder == remainder
    assert sum(s for _, s in plan.sizes) + plan.remainder == 132


def test_invalid_partitions_name_the_problem():
    with pytest.raises(
        ValueError, match=r"'a': 60 SMs is not a positive multiple of 8; valid counts on this device: 8, 16"
    ):
        plan_partitions(132, 8, [("a", 60)])
    with pytest.raises(ValueError, match="ask for 136 SMs; the device has 132"):
        plan_partitions(132, 8, [("a", 128), ("b", 8)])
    assert plan_partitions(132, 8, [("a", 128), ("b", "rest")]).size("b") == 4
    with pytest.raises(ValueError, match="'b' takes the rest, but the other partitions take all 132 SMs"):
        plan_partitions(132, 2, [("a", 132), ("b", "rest")])
    with pytest.raises(ValueError, match="at most one partition may take the rest"):
        plan_partitions(132, 8, [("a", "rest"), ("b", "rest")])
    assert valid_counts(132, 8)[-1] == 128 and valid_counts(132, 8)[0] == 8


def _spec(**over):
    data = {
        "name": "t",
        "partition": [{"name": "p", "sms": 64}, {"name": "q", "sms": "rest"}],
        "node": [
            {"name": "a", "kernel": "sm_probe", "partition": "p", "grid": 8, "block": 32},
            {"name": "b", "kernel": "sm_probe", "partition": "q", "grid": 8, "block": 32, "deps": ["a"]},
            {"name": "c", "kernel": "sm_probe", "partition": "p", "grid": 8, "block": 64, "deps": ["a", "b"]},
        ],
    }
    data.update(over)
    return data


def test_dependency_order_and_node_fields():
    spec = parse_spec(_spec(), known_kernels=["sm_probe"])
    assert [n.name for n in spec.topological_order()] == ["a", "b", "c"]
    plan = spec.plan(132, 8)
    assert plan.size("q") == 68  # every SM the 64 leave
    reordered = _spec(node=list(reversed(_spec()["node"])))
    assert [n.name for n in parse_spec(reordered).topological_order()] == ["a", "b", "c"]


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda d: d["node"][0].update(deps=["c"]), "dependency cycle a -> c -> a"),
        (lambda d: d["node"][1].update(partition="zz"), "unknown partition 'zz'"),
        (lambda d: d["node"][1].update(kernel="nope"), "unknown kernel 'nope'"),
        (lambda d: d["node"][1].update(deps=["ghost"]), "depends on unknown node 'ghost'"),
        (lambda d: d["node"][1].update(block=48), "block = 48"),
        (lambda d: d["node"][1].update(grid=0), "grid = 0"),
        (lambda d: d["node"][1].pop("grid"), "missing grid"),
        (lambda d: d["partition"][0].update(sms=-8), "sms = -8"),
        (lambda d: d.update(partition=[]), "at least one"),
        (lambda d: d["node"][0].update(spin_ns=-1), "spin_ns = -1, expected an integer in"),
        (lambda d: d["node"][0].update(spin_ns=1.5), "spin_ns = 1.5"),
        (lambda d: d["node"][0].update(spinns=100), "unknown key(s) 'spinns'; expected spin_ns"),
        (lambda d: d["node"][1].update(grid=2**40), "grid = 1099511627776 exceeds"),
    ],
)
def test_spec_errors(mutate, message):
    data = _spec()
    mutate(data)
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_spec(data, known_kernels=["sm_probe"])


def test_partition_sizes_are_checked_against_the_device():
    spec = parse_spec(_spec(partition=[{"name": "p", "sms": 60}, {"name": "q", "sms": "rest"}]))
    with pytest.raises(SpecError, match="not a positive multiple of 8"):
        spec.plan(132, 8)


@pytest.mark.parametrize("path", sorted(GRAPHS.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_specs_are_valid_on_a_132_sm_h200(path):
    from megamoe_rt.graph.workloads import KNOWN

    spec = load_spec(path, known_kernels=KNOWN)
    plan = spec.plan(132, 8)
    assert plan.remainder >= 0 and spec.topological_order()


def test_shipped_specs_exist():
    assert len(list(GRAPHS.glob("*.toml"))) >= 2


def test_bad_toml_is_reported(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    with pytest.raises(SpecError, match="not valid TOML"):
        load_spec(bad)


def test_vary_syntax():
    from megamoe_rt.graph.sweep import parse_vary

    assert parse_vary("left=8..32:8") == ("left", [8, 16, 24, 32])
    assert parse_vary("k1=16..16") == ("k1", [16])
    for bad in ("left=8-32", "=8..16", "left=32..8", "left=8..32:0"):
        with pytest.raises(ValueError, match="--vary"):
            parse_vary(bad)


def test_sweep_cli_rejects_bad_arguments_without_a_gpu():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "megamoe_rt", "sweep", "--spec", str(GRAPHS / "nope.toml"), "--vary", "a=8..16"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "megamoe_rt",
            "sweep",
            "--spec",
            str(GRAPHS / "two_partitions_probe.toml"),
            "--vary",
            "left=8-16",
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "--vary" in out.stderr


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda d: d.update(node=["not a table"]), "expected a table"),
        (lambda d: d["node"][2].update(deps=["a", "a"]), "lists a node twice"),
        (lambda d: d["node"][0].update(grid=2**31), "exceeds"),
        (lambda d: d["node"][0].update(smem=300_000), "shared-memory limit"),
    ],
)
def test_more_spec_errors(mutate, message):
    data = _spec()
    mutate(data)
    with pytest.raises(SpecError, match=message):
        parse_spec(data)


def test_unknown_keys_are_spec_errors_naming_them():
    base = {"partition": [{"name": "a", "sms": 8}], "node": []}
    with pytest.raises(SpecError, match="unknown key\\(s\\) 'nodes'"):
        parse_spec(dict(base, nodes=[]))
    with pytest.raises(SpecError, match="partition #1: unknown key\\(s\\) 'smz'"):
        parse_spec({"partition": [{"name": "a", "sms": 8, "smz": 3}]})


def test_a_long_dependency_chain_is_ordered_not_a_recursion_error():
    n = 5000
    nodes = [
        {"name": f"n{i}", "kernel": "probe", "partition": "a", "grid": 1, "block": 32, "deps": [f"n{i + 1}"]}
        for i in range(n - 1)
    ] + [{"name": f"n{n - 1}", "kernel": "probe", "partition": "a", "grid": 1, "block": 32}]
    spec = parse_spec({"partition": [{"name": "a", "sms": 8}], "node": nodes})
    assert [x.name for x in spec.topological_order()] == [f"n{i}" for i in reversed(range(n))]
    nodes[-1]["deps"] = ["n0"]  # close the chain into a cycle
    with pytest.raises(SpecError, match="dependency cycle n0 -> n1 -> "):
        parse_spec({"partition": [{"name": "a", "sms": 8}], "node": nodes})


@pytest.mark.parametrize(
    "kernel,args,message",
    [
        ("stream_copy", {"mib": 0}, "mib = 0"),
        ("stream_copy", {"mib": 10**9}, "mib = 1000000000"),
        ("fp8_gemm", {"m": 100}, "m = 100, expected an integer in [128, 65536], a multiple of 128"),
        ("fp8_gemm", {"k": -128}, "k = -128"),
        ("fp8_gemm", {"n": True}, "n = True"),
    ],
)
def test_workload_arguments_are_checked(kernel, args, message):
    data = _spec()
    data["node"][0].update(kernel=kernel, **args)
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse_spec(data, known_kernels=["sm_probe", kernel])


def test_fine_partitions_come_in_pairs_of_sms():
    plan = plan_partitions(132, 2, [("a", 100), ("b", "rest")])
    assert plan.sizes == (("a", 100), ("b", 32))
    with pytest.raises(ValueError, match="'a': 99 SMs is not a positive multiple of 2"):
        plan_partitions(132, 2, [("a", 99)])
