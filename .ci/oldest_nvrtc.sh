#!/usr/bin/env bash
# Compile every kernel for sm_90a with the oldest NVRTC (and CCCL headers) each CUDA extra
# allows, and fail on a spill or a compile error: a newer NVRTC in the main environment must
# not hide what users of the oldest allowed one get.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet packaging
for extra in cu13 cu12; do
    pins=$(python .ci/oldest_nvrtc.py "$extra" | python -c 'import json,sys; print(" ".join(json.load(sys.stdin)))')
    echo "ci: oldest toolchain of [$extra]: $pins"
    venv=".ci-venv-$extra-oldest"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    # shellcheck disable=SC2086
    "$venv/bin/python" -m pip install --quiet numpy ml-dtypes "nvidia-cutlass>=4.0" "tomli>=2; python_version < '3.11'" $pins
    "$venv/bin/python" -m pip install --quiet --no-deps .
    (cd /tmp && MEGAMOE_RT_CACHE="$OLDPWD/.ci-cache-$extra-oldest" "$OLDPWD/$venv/bin/python" -m megamoe_rt compile --all --json) \
        > ".ci-compile-$extra.json"
    "$venv/bin/python" - ".ci-compile-$extra.json" <<'PY'
import json, sys
from megamoe_rt.jit import nvrtc_version
from megamoe_rt.kernels.registry import all_kernel_specs
rows = json.load(open(sys.argv[1]))
expected = {s.name for s in all_kernel_specs()}
missing = expected - {r["name"] for r in rows}
spills = [f"{r['name']}: {r['spill_bytes']} bytes" for r in rows if r["spill_bytes"]]
print(f"ci: NVRTC {nvrtc_version()}: {len(rows)} kernels, {len(spills)} spilling")
if missing or spills:
    sys.exit(f"ci: missing {sorted(missing)}; spills {spills}")
PY
done
