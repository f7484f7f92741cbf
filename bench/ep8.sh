#!/usr/bin/env bash
# The EP4/EP8 run on one node: the multi-GPU test suite at N ranks, then the layer benchmark
# across N ranks for the flash, pro and v3 presets. Works for any N >= 2.
#
#   bench/ep8.sh [N] [OUT_DIR]      N defaults to the number of visible GPUs
#
# MODES, FLASH_PRO_TOKENS and V3_TOKENS (comma lists) override the arms and token counts.
#
# Writes OUT_DIR/ep<N>_multigpu_tests.txt, ep<N>_flash_pro.json, ep<N>_v3.json and the
# printed tables (ep<N>_bench.txt); run from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."

N=${1:-$(python3 -c "from megamoe_rt import driver; print(sum(d.is_hopper for d in driver.list_devices()))")}
OUT=${2:-bench/results}
mkdir -p "$OUT"
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
if [ "$N" -lt 2 ]; then
    echo "bench/ep8.sh: needs at least 2 Hopper GPUs, found $N" >&2
    exit 1
fi
MODES=${MODES:-unfused,fused}
FLASH_PRO_TOKENS=${FLASH_PRO_TOKENS:-64,128,256,512,2048,8192}
V3_TOKENS=${V3_TOKENS:-128,1024,8192}

echo "== multigpu tests at $N ranks" | tee "$OUT/ep${N}_bench.txt"
MEGAMOE_RT_TEST_RANKS=$N python3 -m pytest -q -m multigpu tests 2>&1 | tee "$OUT/ep${N}_multigpu_tests.txt" | tail -3

echo "== flash, pro at $FLASH_PRO_TOKENS tokens/rank" | tee -a "$OUT/ep${N}_bench.txt"
python3 -m megamoe_rt launch -n "$N" -m megamoe_rt.cli.bench moe --preset flash,pro \
    --tokens "$FLASH_PRO_TOKENS" --mode "$MODES" --rounds 3 -o "$OUT/ep${N}_flash_pro.json" \
    | tee -a "$OUT/ep${N}_bench.txt"

echo "== v3 at $V3_TOKENS tokens/rank" | tee -a "$OUT/ep${N}_bench.txt"
python3 -m megamoe_rt launch -n "$N" -m megamoe_rt.cli.bench moe --preset v3 \
    --tokens "$V3_TOKENS" --mode "$MODES" --rounds 3 -o "$OUT/ep${N}_v3.json" \
    | tee -a "$OUT/ep${N}_bench.txt"
