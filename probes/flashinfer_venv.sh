#!/usr/bin/env bash
# Builds bench/.flashinfer-venv: FlashInfer's Python package at the release vLLM 0.32.0 pins (its wheel's
# Requires-Dist: flashinfer-python==0.7.0.post1) beside torch 2.9.0, for probes/flashinfer_nvfp4_swizzle.py.
# The wheel is pure Python plus CUDA sources it compiles on first use; importing it needs no GPU.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FLASHINFER_VENV:-$REPO/bench/.flashinfer-venv}"
FLASHINFER_VERSION="${FLASHINFER_VERSION:-0.7.0.post1}"
PY="$VENV/bin/python"
# shellcheck source=probes/uv.sh
source "$REPO/probes/uv.sh"

# uv, as for fp8kv's own venv: torch 2.9.0 comes from its cache in seconds.
test -x "$PY" || "$UV" venv --quiet --python "${PYTHON:-python3}" "$VENV"
"$UV" pip install --quiet --python "$PY" "flashinfer-python==$FLASHINFER_VERSION" torch==2.9.0
"$PY" -c "from flashinfer.quantization import fp4_quantization; import flashinfer; print('flashinfer', flashinfer.__version__)"
