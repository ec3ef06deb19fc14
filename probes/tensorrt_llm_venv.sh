#!/usr/bin/env bash
# Builds bench/.tensorrt-llm-venv: TensorRT-LLM from the package index in a venv of its own (it pins its own torch),
# for a probe of its NVFP4 KV-scale loading (tensorrt_llm/_torch/modules/linear.py). Its package names CPython 3.10
# and 3.12, so the venv takes 3.12. It does not build here: the comment above TensorRT-LLM's [[nvfp4]] rows in
# configs/engines.toml has the error line, and this script stops on it.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TENSORRT_LLM_VENV:-$REPO/bench/.tensorrt-llm-venv}"
TENSORRT_LLM_VERSION="${TENSORRT_LLM_VERSION:-1.4.0rc1}"
PY="$VENV/bin/python"
# shellcheck source=probes/uv.sh
source "$REPO/probes/uv.sh"

test -x "$PY" || "$UV" venv --quiet --python "${PYTHON:-python3.12}" "$VENV"
"$UV" pip install --python "$PY" "tensorrt-llm==$TENSORRT_LLM_VERSION"
"$PY" -c "import tensorrt_llm._torch.modules.linear, tensorrt_llm; print('tensorrt_llm', tensorrt_llm.__version__)"
