#!/usr/bin/env bash
# A/B on one machine: the same benchmark in a baseline tree and in this one, back to back, so
# both arms see the same GPU, clocks and drift. The baseline is an exported commit:
#   mkdir .base && git archive <commit> | tar -x -C .base     (.base is git-ignored)
# Usage: bench/ab_run.sh OUTDIR BENCH_ARGS...   e.g. bench/ab_run.sh /tmp/ab gemm --tokens 2048,8192
# AB_JSON_FLAG: the option that names the JSON file in the trees' CLI (default -o; a baseline from before
# -o/--output took `--json PATH`: AB_JSON_FLAG=--json; AB_BASE_JSON_FLAG sets the baseline's alone).
# AB_BASE_TWICE=0 skips the second base run. AB_BASE names another baseline directory (default .base). AB_TREE names another tree for the second arm (default: this one).
# Writes OUTDIR/{base,tree}.json and each arm's log; the order is base, tree, base, so drift
# over the run shows up as a difference between the two base runs.
set -euo pipefail
out=$1
shift
root=$(cd "$(dirname "$0")/.." && pwd)
base=${AB_BASE:-$root/.base}  # AB_BASE: another exported baseline
[ -d "$base/megamoe_rt" ] || { echo "ab_run: no baseline tree at $base" >&2; exit 2; }
mkdir -p "$out"
run_arm() {  # dir name json-flag bench-args...
    (cd "$1" && python3 -m megamoe_rt bench "${@:4}" "$3" "$out/$2.json") 2>&1 | tee "$out/$2.log" | tail -n 30
}
base_flag=${AB_BASE_JSON_FLAG:-${AB_JSON_FLAG:--o}}
run_arm "$base" base "$base_flag" "$@"
run_arm "${AB_TREE:-$root}" tree "${AB_JSON_FLAG:--o}" "$@"
if [ "${AB_BASE_TWICE:-1}" = 1 ]; then run_arm "$base" base2 "$base_flag" "$@"; fi
