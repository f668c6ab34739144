#!/usr/bin/env bash
# The GPU measurements, as one command for a lent machine (its own python3 with JAX CUDA, flax,
# optax): Qwen2.5-0.5B's shape (bench.real_shapes --workload gpu-0.5b; WORKLOAD=gpu-1.5b for
# Qwen2.5-1.5B's), one row per ROW argument:
#   auto         remat and accumulation left at auto: the GPU's compiler chooses, as in a run
#   auto+prof    the same, with one more step under XLA's profiler (its top ops in the log)
#   REMAT/ACCUM  a fixed choice, e.g. dots/1 or none/2 (REMAT/auto: accumulation chosen)
# Default rows: auto+prof dots/auto. WORKLOAD=tiny tries the script on a CPU. Each row is a fresh
# process with a time limit (ROW_S, 280 s), so one that fails or hangs leaves the next its time.
# OUT_DIR gets rows.txt (the machine, each row's exit and time, the table), rows.log (the rows'
# output) and one JSON per row.
#
#     bash bench/gpu.sh OUT_DIR [ROW ...]
set -u
out=${1:-bench-gpu}
shift || true
[ $# -gt 0 ] || set -- auto+prof dots/auto
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$out/rows.txt"
$py -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())" 2>&1 | tee -a "$out/rows.txt"
for spec in "$@"; do
    args=(--steps "${STEPS:-3}")
    case $spec in
    auto) args+=(--remat auto) ;;
    auto+prof) args+=(--remat auto --profile) ;;
    */*) args+=(--remat "${spec%/*}" --accum "${spec#*/}") ;;
    *) echo "unknown row $spec" >&2; exit 2 ;;
    esac
    name=${WORKLOAD:-gpu-0.5b}-${spec//[\/+]/-}
    t0=$SECONDS
    timeout "${ROW_S:-280}" $py -m bench.real_shapes --workload "${WORKLOAD:-gpu-0.5b}" --json "$out/$name.json" "${args[@]}" \
        >"$out/row.log" 2>&1
    echo "$spec: exit $? after $((SECONDS - t0)) s" | tee -a "$out/rows.txt"
    grep -iE 'remat=|^  memory|out of memory|RESOURCE_EXHAUSTED|Traceback|Error' "$out/row.log" | cut -c1-400 | head -8
    { echo "== $spec"; cat "$out/row.log"; } >>"$out/rows.log" && rm "$out/row.log"
done
# the rows together, one table
{
$py - "$out" <<'PY'
import glob, json, sys
from bench.real_shapes import _table
rows = [r for f in sorted(glob.glob(sys.argv[1] + "/*.json")) for r in json.load(open(f))["rows"]]
print(_table(rows))
PY
} | tee -a "$out/rows.txt"
