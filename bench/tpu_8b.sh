#!/usr/bin/env bash
# On a TPU VM (v5e/v6e, one chip is enough for 8B in bf16): build an 8B-shaped random llama on local
# disk, calibrate it on the host CPU, run `fp8kv verify --device tpu` (the Pallas kernel) and bf16 vs fp8
# decode tokens/s, write $OUT/tpu_8b.json with peak TPU memory. Needs fp8kv's [tpu] extra installed
# (torch 2.9.0, torch_xla 2.9.0, libtpu, jax) in the machine's Python. Not yet run: no TPU was available.
#   run: bash bench/tpu_8b.sh      (the checkpoint, ~16 GB, is deleted afterwards)
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$( [ -x "$REPO/.venv/bin/python" ] && echo "$REPO/.venv/bin/python" || command -v python3 )}"
OUT="${OUT:-$REPO/bench/results}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/fp8kv-tpu-XXXX")"
trap 'rm -rf "$WORK"' EXIT
# The repository root is the fp8kv package: expose it under that name without installing.
mkdir -p "$WORK/path" && ln -s "$REPO" "$WORK/path/fp8kv"
export PYTHONPATH="$WORK/path${PYTHONPATH:+:$PYTHONPATH}"
unset PJRT_DEVICE  # torch_xla picks the TPU
"$PY" -c "import torch, torch_xla, jax; print('torch', torch.__version__, 'torch_xla', torch_xla.__version__, 'jax', jax.__version__, 'TPU v%d' % torch_xla.tpu.version())"
df -h "$WORK" | tail -1
mkdir -p "$OUT"
"$PY" "$REPO/bench/tpu_8b.py" --root "$WORK" --results "$OUT/tpu_8b.json" "$@"
