#!/usr/bin/env bash
# Builds bench/.sglang-venv: SGLang from the package index in a venv of its own, for loadcheck/probes/sglang.py.
# SGLang 0.5.23 pins torch 2.14.1 and fp8kv's venv runs torch 2.9.0 (torch_xla's pin), so the two cannot share one.
# Its wheels hold compiled extensions, one per CPython (cp311, cp312; Requires-Python >=3.11): python3 is 3.11 here.
# About 11 GB: torch's CUDA build and SGLang's CUDA kernel packages, which loading never runs; all of them install
# on a machine without a GPU, so nothing is left out.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SGLANG_VENV:-$REPO/bench/.sglang-venv}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
TORCH_VERSION="${TORCH_VERSION:-2.14.1}"
PY="$VENV/bin/python"

# uv, as for fp8kv's own venvs: its cache hardlinks every file into the venv, so a rebuild takes neither a second
# copy of the wheels on disk nor their download. Where no uv is on PATH, the Makefile's own (its pinned release).
# shellcheck source=probes/uv.sh
source "$REPO/probes/uv.sh"
# --seed: pip in the venv, which probes/install_beside_engines.py asks what installing fp8kv there would change.
test -x "$PY" || "$UV" venv --quiet --seed --python "${PYTHON:-python3}" "$VENV"
WHEELS="$VENV/wheels"
"$PY" -m pip download --quiet --no-cache-dir --no-deps "sglang==$SGLANG_VERSION" -d "$WHEELS"
# The wheel for this venv's CPython (older releases are one pure-Python wheel), kept for its sha256.
TAG="$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
WHEEL=""
for candidate in "$WHEELS"/sglang-"$SGLANG_VERSION"-"$TAG"-*.whl "$WHEELS"/sglang-"$SGLANG_VERSION"-py3-none-any.whl; do
    if [ -z "$WHEEL" ] && [ -f "$candidate" ]; then WHEEL="$candidate"; fi
done
test -n "$WHEEL" || { echo "no sglang $SGLANG_VERSION wheel for $TAG in $WHEELS" >&2; exit 1; }
"$UV" pip install --quiet --python "$PY" "$WHEEL" "torch==$TORCH_VERSION"
"$PY" -c "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)"
