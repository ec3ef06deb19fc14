#!/usr/bin/env bash
# On a lent CUDA machine (device tool): the engine models' fp8 writes against the GPU's own arithmetic
# (probes/gpu_writes.py), every bf16 and fp16 value at ten scales; $OUT/gpu_writes.json, exit 0 when vllm-cuda
# and sglang match their models byte for byte (vllm-triton's approximate division is counted, not judged).
# Needs torch (CUDA) and triton in the machine's Python, nothing else; run it on torch 2.11 to check SGLang's
# own. Not run in the session that wrote it (no GPU was lent); under a minute on an H200.
#   run: bash probes/gpu_writes.sh
set -euo pipefail
NAME=writes
source "$(dirname "$0")/../bench/machine_env.sh"
needs_cuda
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
nvidia-smi --query-gpu=name,compute_cap --format=csv || true
"$PY" "$REPO/probes/gpu_writes.py" --out "$OUT/gpu_writes.json"
