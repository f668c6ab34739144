#!/usr/bin/env bash
# The one install recipe of this project: `make install` (and so `make demo`, `make test` and CI
# on a clean clone) and the Dockerfile's images run it.
#
#   scripts/install.sh [VENV] [PYTHON] [VARIANT]      defaults: .venv python3 cpu
#
# VARIANT: cpu, or tpu (adds jax[tpu] at the jax version constraints.txt pins, with libtpu).
# GRPO_DEV=0 installs the project alone (an image), not editable and without the dev tools.
# GRPO_INSTALL_DRY_RUN=1 prints the commands instead of running them.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
PYTHON="${2:-python3}"
VARIANT="${3:-cpu}"
DEV="${GRPO_DEV:-1}"
case "$VARIANT" in
    cpu | tpu) ;;
    *) echo "scripts/install.sh: variant must be cpu or tpu, got '$VARIANT'" >&2; exit 2 ;;
esac

run() {
    if [ "${GRPO_INSTALL_DRY_RUN:-0}" = 1 ]; then echo "$*"; else "$@"; fi
}

run "$PYTHON" -m venv "$VENV"
run "$VENV/bin/python" -m pip install -q --upgrade pip
if [ "$DEV" = 1 ]; then
    # tpu-aot: libtpu's compiler, so the tests check TPU targets (grpo check --target) on any host
    run "$VENV/bin/python" -m pip install -q -c constraints.txt -e '.[dev,tpu-aot]'
else
    run "$VENV/bin/python" -m pip install -q -c constraints.txt .
fi
if [ "$VARIANT" = tpu ]; then
    jax_version="$(sed -n 's/^jax==//p' constraints.txt)"
    [ -n "$jax_version" ] || { echo "scripts/install.sh: constraints.txt pins no jax version" >&2; exit 2; }
    run "$VENV/bin/python" -m pip install -q "jax[tpu]==$jax_version" \
        -f https://storage.googleapis.com/jax-releases/libtpu_releases.html
fi
