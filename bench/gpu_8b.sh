#!/usr/bin/env bash
# On a lent CUDA machine (device tool): build an 8B-shaped random llama on local disk, calibrate it
# whole-model and layer by layer, write $OUT/gpu_8b.json. Needs torch (CUDA), transformers 5,
# safetensors, datasets, tokenizers, typer and rich in the machine's Python (no network there).
#   run: bash bench/gpu_8b.sh      (about 5 minutes on an H200; the checkpoint is deleted afterwards)
set -euo pipefail
NAME=gpu
source "$(dirname "$0")/machine_env.sh"
needs_cuda
"$PY" -c "import torch, transformers, safetensors, datasets; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true
df -h "$WORK" | tail -1
"$PY" "$REPO/bench/gpu_8b.py" all --root "$WORK" --results "$OUT/gpu_8b.json"
