#!/usr/bin/env bash
# The one install recipe of this project: `make demo`, `make test` (and so CI on a clean clone)
# and the Dockerfile's images run it.
#
#   scripts/install.sh [VENV] [PYTHON] [VARIANT] [LEVEL]      defaults: .venv python3 cpu dev
#
# VARIANT: cpu, or tpu (adds jax[tpu] at the jax version constraints.txt pins, with libtpu).
# LEVEL, what goes in:
#   demo   the project alone, editable: all `grpo demo` and `grpo run` import (make demo)
#   dev    that and the dev tools, the trackers, torch, Ray and libtpu's compiler (make test);
#          over a demo install it adds only the difference
#   image  the project alone, not editable (the Docker images); GRPO_DEV=0 means it too
# The installer is uv (pinned in constraints.txt, from PyPI into a folder of its own, removed at
# the end), with pip's own configuration (indexes, find-links, constraints, certificate) passed on:
# on a 2-core machine it installed the demo's packages in 98 s where pip took 305, and `make demo`
# from a fresh clone took 2.4 min instead of 5.3 (docs/development.md). GRPO_INSTALLER=pip uses pip.
# Each phase says when it starts and how long it took, and a phase that runs long says so every
# GRPO_INSTALL_TICK_S seconds (20), where no progress bar of the installer's shows it.
# GRPO_INSTALL_DRY_RUN=1 prints the commands instead of running them.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
PYTHON="${2:-python3}"
VARIANT="${3:-cpu}"
LEVEL="${4:-dev}"
[ "${GRPO_DEV:-1}" = 0 ] && LEVEL=image
INSTALLER="${GRPO_INSTALLER:-uv}"
DRY="${GRPO_INSTALL_DRY_RUN:-0}"
TICK_S="${GRPO_INSTALL_TICK_S:-20}"
case "$VARIANT" in
    cpu | tpu) ;;
    *) echo "scripts/install.sh: variant must be cpu or tpu, got '$VARIANT'" >&2; exit 2 ;;
esac
case "$LEVEL" in
    demo) spec=(-e .); usually="about a minute (1.3 GB)" ;;
    dev) spec=(-e '.[dev,tpu-aot]'); usually="about a minute over the demo's, 2-4 from nothing (3.5 GB)" ;;
    image) spec=(.); usually="1-3 minutes" ;;
    *) echo "scripts/install.sh: level must be demo, dev or image, got '$LEVEL'" >&2; exit 2 ;;
esac
case "$INSTALLER" in
    uv | pip) ;;
    *) echo "scripts/install.sh: GRPO_INSTALLER must be uv or pip, got '$INSTALLER'" >&2; exit 2 ;;
esac

started=$SECONDS
pid=""
boot=""
cleanup() {
    [ -z "$pid" ] || kill "$pid" 2>/dev/null || true
    [ "$DRY" = 1 ] || [ -z "$boot" ] || rm -rf "$boot"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

took() { local s=$(($1)); [ "$s" -lt 60 ] && echo "${s} s" || echo "$((s / 60)) min $((s % 60)) s"; }

# phase N/M "what" [bar] COMMAND...: a line when it starts, one every TICK_S while it runs (unless
# `bar`: the installer draws its own progress on a terminal), and its time when it ends.
phase() {
    local what="$1" bar="$2"
    shift 2
    echo "install: $what"
    if [ "$DRY" = 1 ]; then echo "$*"; return; fi
    local t0=$SECONDS rc=0 next=$((SECONDS + TICK_S))
    "$@" &
    pid=$!
    while kill -0 "$pid" 2>/dev/null; do
        sleep 1
        if [ "$SECONDS" -ge "$next" ] && ! { [ "$bar" = bar ] && [ -t 2 ]; }; then
            echo "install:   ... $(took SECONDS-t0), $VENV $(du -sh "$VENV" 2>/dev/null | cut -f1) so far"
            next=$((SECONDS + TICK_S))
        fi
    done
    wait "$pid" || rc=$?
    pid=""
    [ "$rc" = 0 ] || { echo "install: failed ($what), exit code $rc" >&2; exit "$rc"; }
    echo "install:   done in $(took SECONDS-t0)"
}

# An environment there already (make demo's, which make test adds to) is kept as it is.
have_venv() { [ "$DRY" != 1 ] && [ -x "$VENV/bin/python" ]; }

# pip's configuration (pip.conf files and PIP_* variables) as uv's options: uv reads none of it.
# (The Dockerfile's PIP_NO_CACHE_DIR=1 keeps uv's cache out of the images' layers too.)
uv_options=()
pip_config() {
    local line key value seen=" " first=" "
    while IFS= read -r line; do
        key="${line%%=*}"
        key="${key#*.}"
        value="${line#*=}"
        value="${value#\'}"
        value="${value%\'}"
        case "$key" in
            index-url | cert | default-timeout | no-cache-dir)  # one value: the first pip lists (its environment's)
                [[ "$first" == *" $key "* ]] && continue
                first+="$key "
                case "$key" in
                    index-url) uv_options+=(--index-url "$value") ;;
                    cert) export SSL_CERT_FILE="$value" ;;
                    default-timeout) export UV_HTTP_TIMEOUT="$value" ;;
                    no-cache-dir) case "$value" in 1 | true | yes | on) export UV_NO_CACHE=1 ;; esac ;;  # images
                esac ;;
            extra-index-url | find-links | constraint)  # several: each once
                for v in $value; do
                    [[ "$seen" == *" $key=$v "* ]] && continue
                    seen+="$key=$v "
                    uv_options+=("--$key" "$v")
                done ;;
        esac
    done < <("$1" -m pip config list 2>/dev/null)
    # pip takes the best version from every index; uv's default takes the first index that has the package
    [[ "$seen" == *" extra-index-url="* ]] && uv_options+=(--index-strategy unsafe-best-match)
    return 0
}

[ "$INSTALLER" = uv ] || usually="3-5 times as long as with uv"
echo "install: $LEVEL into $VENV with $INSTALLER ($VARIANT); this usually takes $usually on a 2-core machine"
have_venv || phase "$VENV, a virtual environment ($PYTHON)" - "$PYTHON" -m venv "$VENV"
if [ "$INSTALLER" = uv ]; then
    boot="\$BOOT"
    [ "$DRY" = 1 ] || boot="$(mktemp -d)"
    phase "uv, the installer, from PyPI" - "$VENV/bin/python" -m pip install -q --target "$boot" -c constraints.txt uv
    [ "$DRY" = 1 ] || pip_config "$VENV/bin/python"
    # Bytecode: this machine's processes may not write it (PYTHONDONTWRITEBYTECODE), so each would
    # compile what it imports again. dev and image: all of it. demo: what its processes import (below).
    [ "$LEVEL" = demo ] || export UV_COMPILE_BYTECODE=1
    install=("$boot/bin/uv" pip install --python "$VENV/bin/python" "${uv_options[@]}")
else
    phase "pip, up to date" - "$VENV/bin/python" -m pip install -q --upgrade pip
    install=("$VENV/bin/python" -m pip install --progress-bar on)
fi
phase "the project and its packages (constraints.txt)" bar "${install[@]}" -c constraints.txt "${spec[@]}"
if [ "$VARIANT" = tpu ]; then
    jax_version="$(sed -n 's/^jax==//p' constraints.txt)"
    [ -n "$jax_version" ] || { echo "scripts/install.sh: constraints.txt pins no jax version" >&2; exit 2; }
    phase "jax[tpu], with libtpu" bar "${install[@]}" "jax[tpu]==$jax_version" \
        -f https://storage.googleapis.com/jax-releases/libtpu_releases.html
fi
if [ "$LEVEL" = demo ] && [ "$INSTALLER" = uv ]; then
    # compiled by importing what the CLI, the flow and a worker import: a third of the packages'
    # modules (the rest, never imported by a demo, would add ~0.3 GB and a minute)
    phase "bytecode of what the demo imports" - env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" -c \
        "import flows.cli, flows.pipeline, tasks.stages, grpo_core.stages.ahead, grpo_core.stages.worker as w; w.preload()"
fi
if [ "$LEVEL" = dev ] && [ "$INSTALLER" = uv ]; then
    # uv compiles what this install added; a demo's install before it left two thirds of the
    # packages (Prefect's server among them) as sources, which every test's process compiled again.
    # compileall skips what is compiled already (its one error: a torch file in Python 3.12 syntax).
    phase "bytecode of the packages a demo's install left as sources" - "$VENV/bin/python" -c \
        "import compileall, sysconfig; compileall.compile_dir(sysconfig.get_paths()['purelib'], quiet=2, workers=0)"
fi
echo "install: $LEVEL installed in $VENV in $(took SECONDS-started)"
