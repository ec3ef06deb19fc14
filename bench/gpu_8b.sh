#!/usr/bin/env bash
# On a lent CUDA machine (device tool): build an 8B-shaped random llama on local disk, calibrate it
# whole-model and layer by layer, write $OUT/gpu_8b.json. Needs torch (CUDA), transformers 5,
# safetensors, datasets, tokenizers, typer and rich in the machine's Python (no network there).
#   run: bash bench/gpu_8b.sh      (about 5 minutes on an H200; the checkpoint is deleted afterwards)
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$( [ -x "$REPO/.venv/bin/python" ] && echo "$REPO/.venv/bin/python" || command -v python3 )}"
OUT="${OUT:-$REPO/bench/results}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/fp8kv-gpu-XXXX")"
trap 'rm -rf "$WORK"' EXIT
# The repository root is the fp8kv package: expose it under that name without installing.
mkdir -p "$WORK/path" && ln -s "$REPO" "$WORK/path/fp8kv"
export PYTHONPATH="$WORK/path${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch, transformers, safetensors, datasets; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true
df -h "$WORK" | tail -1
"$PY" "$REPO/bench/gpu_8b.py" all --root "$WORK" --results "$OUT/gpu_8b.json"
