#!/usr/bin/env bash
# Builds bench/.llmcompressor-venv: llm-compressor 0.14 from the package index in a venv of its own, as its users
# install it (torch's CUDA build and NVIDIA's libraries included, though no GPU runs here), for
# probes/install_beside_engines.py.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LLMCOMPRESSOR_VENV:-$REPO/bench/.llmcompressor-venv}"
LLMCOMPRESSOR_VERSION="${LLMCOMPRESSOR_VERSION:-0.14.*}"
PY="$VENV/bin/python"
# A cached copy of every wheel beside a venv of several GB has filled disks before.
export PIP_NO_CACHE_DIR=1

test -x "$PY" || "${PYTHON:-python3}" -m venv "$VENV"
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install --quiet "llmcompressor==$LLMCOMPRESSOR_VERSION"
"$PY" -c "import llmcompressor, torch, transformers; print('llmcompressor', llmcompressor.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
