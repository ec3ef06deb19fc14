#!/usr/bin/env bash
# On a TPU VM (v5e/v6e, one chip is enough for 8B in bf16): build an 8B-shaped random llama on local
# disk, calibrate it on the host CPU, run `fp8kv verify --device tpu` (the Pallas kernel) and bf16 vs fp8
# decode tokens/s, write $OUT/tpu_8b.json with peak TPU memory. Needs fp8kv's [tpu] extra installed
# (torch 2.9.0, torch_xla 2.9.0, libtpu, jax) in the machine's Python. Not yet run: no TPU was available.
#   run: bash bench/tpu_8b.sh      (the checkpoint, ~16 GB, is deleted afterwards)
set -euo pipefail
NAME=tpu
source "$(dirname "$0")/machine_env.sh"
unset PJRT_DEVICE  # torch_xla picks the TPU
"$PY" -c "import torch, torch_xla, jax; print('torch', torch.__version__, 'torch_xla', torch_xla.__version__, 'jax', jax.__version__, 'TPU v%d' % torch_xla.tpu.version())"
df -h "$WORK" | tail -1
"$PY" "$REPO/bench/tpu_8b.py" --root "$WORK" --results "$OUT/tpu_8b.json" "$@"
