#!/usr/bin/env bash
# The two-GPU runs: measurements and checks that ranks sharing one GPU cannot give (they take
# turns on it, so their timings mean nothing and races that need two GPUs at once stay hidden).
# Each stage fits a 10-minute job on a node with two Hopper GPUs; run from the repository root:
#
#   bench/ep2_runs.sh STAGE [OUT_DIR]        OUT_DIR defaults to bench/results
#
#   tests      the multigpu suite at two ranks, then 10 new random configurations across ranks
#   overhead   eager calls against graph replays across two ranks (flash, 64 and 2048 tokens,
#              unfused and fused), then the two-rank example under torchrun
#   stream     router + layer, streamed against sequential, across two ranks (flash, v3)
#   transport  unfused over NVSHMEM's device API against peer pointers (flash, v3 x 128/2048/8192)
#   prefill    long calls against the ring size across two ranks (flash, pro x 16K/32K tokens)
#
# Writes OUT_DIR/ep2_<stage>.txt (and .json / .png where the benchmark has one).
set -euo pipefail
cd "$(dirname "$0")/.."

STAGE=${1:?"usage: bench/ep2_runs.sh tests|overhead|stream|transport|prefill [OUT_DIR]"}
OUT=${2:-bench/results}
mkdir -p "$OUT"
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
unset MEGAMOE_RT_RANK_DEVICES  # one GPU per rank
log="$OUT/ep2_$STAGE.txt"
launch() { python3 -m megamoe_rt launch -n 2 -m megamoe_rt.cli.bench "$@"; }

case "$STAGE" in
tests)
    MEGAMOE_RT_TEST_RANKS=2 python3 -m pytest -q -m multigpu tests/multigpu -rfE 2>&1 | tee "$log"
    MEGAMOE_RT_TEST_RANKS=2 MEGAMOE_RT_RANDOM_CONFIGS=10 python3 -m pytest -q -m multigpu \
        tests/multigpu/test_random_configs_multigpu.py -rfE 2>&1 | tee -a "$log"
    ;;
overhead)
    launch overhead --preset flash --tokens 64,2048 --mode fused,unfused -o "$OUT/ep2_overhead.json" | tee "$log"
    MEGAMOE_RT_TEST_RANKS=2 python3 -m pytest -q -m multigpu tests/multigpu/test_launchers_multigpu.py -rfE 2>&1 \
        | tee -a "$log"
    ;;
stream)
    launch stream --preset flash,v3 --tokens 512,2048,8192 -o "$OUT/ep2_stream.json" | tee "$log"
    ;;
transport)
    launch moe --preset flash,v3 --tokens 128,2048,8192 --mode unfused@nvlink,unfused@nvshmem --rounds 3 \
        -o "$OUT/ep2_transport.json" | tee "$log"
    ;;
prefill)
    launch prefill --preset flash,pro --tokens 16384,32768 -o "$OUT/ep2_prefill.json" \
        --png "$OUT/ep2_prefill.png" | tee "$log"
    ;;
*)
    echo "bench/ep2_runs.sh: unknown stage '$STAGE' (tests, overhead, stream, transport, prefill)" >&2
    exit 2
    ;;
esac
