#!/usr/bin/env bash
# The one-GPU runs still owed by code that so far ran only on the CPU (NVRTC builds, SASS and
# spill checks, plans and models). Each stage fits a 10-minute job on one Hopper GPU; run from
# the repository root:
#
#   bench/one_gpu_runs.sh STAGE [OUT_DIR]        OUT_DIR defaults to bench/results
#
#   verify     the GPU tests of the layer (its facade and the runtime modules: every call path),
#              token windows, the fused and split modes, prefill, streaming, device errors,
#              deadlines, the driver and graphs, the streamed order's probe
#   verify-ep  the cross-rank tests (rings, token windows, the three modes, streaming) with
#              both ranks on GPU 0 (correctness only)
#   gemm       the GEMM tests (every tile, 128x256 and the CTA pairs included, each also on few
#              blocks so every block walks many tiles), the examples and the README
#   tiles      bench gemm with the heuristic's tile, 128x128, 128x256 and 128x128 CTA pairs side by
#              side (flash, pro, v3 x 2048/8192, with the torch peers), then Nsight Compute's
#              tensor-pipe and shared-memory figures of flash L1 8192 on each where ncu reads counters
#   prefill    long calls against rings and a 16K-token window: 16384 and 65536 tokens in three
#              rounds (the 16K call is the window's own cost alone), then 131072 in one
#   overhead   eager calls against graph replays, host us per eager call (every mode)
#   faults     the fault suite on this tree (python -m megamoe_rt.cli.faults)
#   stream     the streamed calls: one fused call in the consumer-first order (bench/stream_diag.py),
#              the streamed tests in both modes, bench stream against sequential fused with the
#              producer's SMs swept, and the stage trace of one streamed call
#   host       where an eager call's host time goes (bench/host_call_profile.py, every mode), then
#              bench overhead
#   gemm-first the most per minute after a mainloop change, in one 10-minute job: the GEMM tests,
#              bench gemm at 8192 tokens base / tree / base (.base as for ab), then this tree's
#              tiles side by side at 8192 tokens
#   arch-ab    bench overhead and bench moe in every mode, at 64 and 2048 tokens, in .base-arch (the
#              tree before the object model and host-path work, e30b8b7: mkdir .base-arch && git archive
#              e30b8b7 | tar -x -C .base-arch; carry it) and in this one, base then tree
#   ab         bench gemm and bench moe (fused) in the baseline tree .base and in this one, base /
#              tree / base (bench/ab_run.sh; export the baseline first and carry .base:
#              mkdir .base && git archive <commit> | tar -x -C .base)
#
# Every stage first builds every kernel into the cache in parallel (compile --all), so that no
# test or arm pays a compile inside its time.
#
# Writes OUT_DIR/one_gpu_<stage>.txt (and .json / .md where the run has one).
set -euo pipefail
cd "$(dirname "$0")/.."

STAGE=${1:?"usage: bench/one_gpu_runs.sh verify|verify-ep|gemm|gemm-first|tiles|prefill|overhead|faults|ab|arch-ab|stream|host [OUT_DIR]"}
OUT=${2:-bench/results}
mkdir -p "$OUT"
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
log="$OUT/one_gpu_$STAGE.txt"

case "$STAGE" in
verify | verify-ep | gemm | gemm-first | tiles | prefill | overhead | faults | ab | arch-ab | stream | host) ;;
*)
    echo "bench/one_gpu_runs.sh: unknown stage '$STAGE' (verify, verify-ep, gemm, gemm-first, tiles, prefill, overhead, faults, ab, arch-ab, stream, host)" >&2
    exit 2
    ;;
esac
python3 -m megamoe_rt compile --all >"$OUT/one_gpu_${STAGE}_compile.txt" 2>&1
if [ "$STAGE" = ab ] || [ "$STAGE" = gemm-first ] || [ "$STAGE" = arch-ab ]; then
    base=.base
    [ "$STAGE" = arch-ab ] && base=.base-arch
    [ -d $base/megamoe_rt ] || { echo "bench/one_gpu_runs.sh $STAGE: no baseline tree in $base" >&2; exit 2; }
    (cd $base && python3 -m megamoe_rt compile --all) >"$OUT/one_gpu_${STAGE}_base_compile.txt" 2>&1
fi

case "$STAGE" in
verify)
    python3 -m pytest -q -m gpu -rfE tests/gpu/test_layer_gpu.py tests/gpu/test_token_window_gpu.py \
        tests/gpu/test_fused_gpu.py tests/gpu/test_split_gpu.py tests/gpu/test_prefill_gpu.py \
        tests/gpu/test_stream_gpu.py tests/gpu/test_device_errors_gpu.py tests/gpu/test_deadlines_gpu.py \
        tests/gpu/test_driver_gpu.py tests/gpu/test_graph_gpu.py tests/gpu/test_stream_order_gpu.py 2>&1 | tee "$log"
    ;;
verify-ep)
    MEGAMOE_RT_RANK_DEVICES=0 python3 -m pytest -q -m multigpu -rfE tests/multigpu/test_prefill_multigpu.py \
        tests/multigpu/test_ep_multigpu.py tests/multigpu/test_stream_multigpu.py 2>&1 | tee "$log"
    ;;
gemm)
    python3 -m pytest -q -m gpu -rfE tests/gpu/test_gemm_gpu.py tests/gpu/test_examples_gpu.py \
        tests/gpu/test_readme_gpu.py 2>&1 | tee "$log"
    ;;
gemm-first)
    python3 -m pytest -q -m gpu -rfE -x tests/gpu/test_gemm_gpu.py 2>&1 | tee "$log"
    bench/ab_run.sh "$OUT/ab_gemm_8192" gemm --presets flash,pro,v3 --tokens 8192 2>&1 | tee -a "$log"
    python3 -m megamoe_rt bench gemm --presets flash,v3 --tokens 8192 --tiles 128x128,128x256,128x128c2 --no-torch \
        -o "$OUT/one_gpu_gemm_first_tiles.json" 2>&1 | tee -a "$log"
    ;;
tiles)
    python3 -m megamoe_rt bench gemm --presets flash,pro,v3 --tokens 2048,8192 --tiles 128x128,128x256,128x128c2 \
        -o "$OUT/one_gpu_tiles.json" 2>&1 | tee "$log"
    if command -v ncu >/dev/null; then
        for tile in 128x128 128x256 128x128c2; do
            ncu --clock-control none -k regex:sm90_fp8_grouped_gemm -c 1 \
                --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__cycles_active.avg,gpu__time_duration.sum \
                python3 bench/gemm_profile_one.py "$tile" 2>&1 | tee -a "$log"
        done
    fi
    ;;
prefill)
    python3 -m megamoe_rt bench prefill --presets flash,pro --tokens 16384,65536 --ratios 0.25 --windows 16384 \
        --rounds 3 -o "$OUT/one_gpu_prefill.json" 2>&1 | tee "$log"
    python3 -m megamoe_rt bench prefill --presets flash,pro --tokens 131072 --ratios 0.25 --windows 16384 \
        --rounds 1 -o "$OUT/one_gpu_prefill_131072.json" 2>&1 | tee -a "$log"
    ;;
overhead)
    python3 -m megamoe_rt bench overhead --preset flash,v3 --tokens 64,2048 --mode fused,unfused,split \
        -o "$OUT/one_gpu_overhead.json" 2>&1 | tee "$log"
    ;;
ab)
    bench/ab_run.sh "$OUT/ab_gemm" gemm --presets flash,pro,v3 --tokens 2048,8192 2>&1 | tee "$log"
    AB_BASE_TWICE=0 bench/ab_run.sh "$OUT/ab_moe" moe --mode fused --preset flash,v3 --tokens 2048,8192 \
        2>&1 | tee -a "$log"
    ;;
arch-ab)
    # The baseline's bench names its JSON file with --json PATH.
    AB_BASE=.base-arch AB_BASE_JSON_FLAG=--json AB_BASE_TWICE=0 bench/ab_run.sh "$OUT/arch_ab_overhead" overhead \
        --presets flash,v3 --tokens 64,2048 --mode fused,unfused,split 2>&1 | tee "$log"
    AB_BASE=.base-arch AB_BASE_JSON_FLAG=--json AB_BASE_TWICE=0 bench/ab_run.sh "$OUT/arch_ab_moe" moe \
        --mode fused,unfused,split --presets flash,v3 --tokens 64,2048 --no-torch 2>&1 | tee -a "$log"
    ;;
stream)
    python3 bench/stream_diag.py 256 4 256 2>&1 | tee "$log"
    MEGAMOE_RT_TIMEOUT_S=10 python3 -m pytest -q -m gpu -rfE tests/gpu/test_stream_gpu.py 2>&1 | tee -a "$log"
    for sms in 8 16 33; do
        python3 -m megamoe_rt bench stream --presets flash,v3 --tokens 512,2048,8192 --producer-sms "$sms" \
            -o "$OUT/one_gpu_stream_psms$sms.json" 2>&1 | tee -a "$log"
    done
    python3 -m megamoe_rt trace --preset flash --tokens 8192 --stream 4x512 -o "$OUT/one_gpu_stream_trace.json" \
        2>&1 | tee -a "$log"
    ;;
host)
    python3 bench/host_call_profile.py --preset flash --tokens 64 2>&1 | tee "$log"
    python3 -m megamoe_rt bench overhead --preset flash,v3 --tokens 64,2048 --mode fused,unfused,split \
        -o "$OUT/one_gpu_overhead.json" 2>&1 | tee -a "$log"
    ;;
faults)
    python3 -m megamoe_rt.cli.faults --md "$OUT/one_gpu_faults.md" -o "$OUT/one_gpu_faults.json" 2>&1 | tee "$log"
    ;;
esac
