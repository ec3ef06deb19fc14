#!/usr/bin/env bash
# On a lent CUDA machine (device tool): the NVFP4 cache write vLLM 0.32.0 runs on sm80/sm90/sm120 (FlashInfer
# 0.7.0.post1's slot-mapping write, built from its headers with its JIT's flags) on hard-case bf16 K/V, recorded
# byte for byte in $OUT/nvfp4-flashinfer-write.json and held against fp8kv's write (probes/gpu_nvfp4.py); exit 0
# when every byte matches, 1 when some differ (the counts are printed and the recording kept either way).
# The machine has no network and carries at most 64 MiB, so FlashInfer's Python does not travel: six of its headers
# and its vendored CCCL do (bench/.gpu-nvfp4, 15 MB).
#   here, once:  bash probes/gpu_nvfp4.sh --prepare   (flashinfer-python's 34 MB wheel, what the build needs
#                                                       of it kept in bench/.gpu-nvfp4, gitignored)
#   here:        bash probes/gpu_nvfp4.sh --dry-run   (the headers, nvcc, ninja and fp8kv's side; no GPU)
#   on the GPU:  carry bench/.gpu-nvfp4, run: bash probes/gpu_nvfp4.sh   (nvcc builds it: about a minute)
set -euo pipefail
NAME=nvfp4
source "$(dirname "$0")/../bench/machine_env.sh"
INCLUDE="${FLASHINFER_INCLUDE:-$REPO/bench/.gpu-nvfp4/include}"
HEADERS="$("$PY" -c 'import sys; sys.path.insert(0, sys.argv[1]); import gpu_nvfp4; print(*gpu_nvfp4.HEADERS)' "$REPO/probes")"

if [ "${1:-}" = --prepare ]; then
    python3 -m pip download --quiet --no-deps flashinfer-python==0.7.0.post1 -d "$WORK"
    mkdir -p "$INCLUDE/flashinfer"
    for header in $HEADERS; do
        unzip -q -o -j "$WORK"/flashinfer_python-0.7.0.post1-*.whl "flashinfer/data/include/flashinfer/$header" \
            -d "$INCLUDE/flashinfer"
    done
    # the CCCL FlashInfer vendors and puts before CUDA's own (fastdiv.cuh needs its cuda::fast_mod_div): 15 MB
    unzip -q -o "$WORK"/flashinfer_python-0.7.0.post1-*.whl "flashinfer/data/cccl/libcudacxx/include/*" -d "$WORK/wheel"
    rm -rf "$INCLUDE/../cccl" && mv "$WORK/wheel/flashinfer/data/cccl/libcudacxx/include" "$INCLUDE/../cccl"
    echo "$NAME: FlashInfer 0.7.0.post1's headers in $INCLUDE/flashinfer"
    exit 0
fi

[ "${1:-}" = --dry-run ] || needs_cuda
# what the GPU run needs besides the GPU, asked before any of its time is spent
for header in $HEADERS; do
    test -f "$INCLUDE/flashinfer/$header" -a -f "$INCLUDE/../cccl/cuda/cmath" \
        || { echo "$NAME: no $INCLUDE/flashinfer/$header or CCCL beside it; run bash probes/gpu_nvfp4.sh --prepare here first"; exit 4; }
done
command -v nvcc > /dev/null || { echo "$NAME: no nvcc on PATH to build FlashInfer's write"; exit 4; }
"$PY" -c "from torch.utils.cpp_extension import verify_ninja_availability; verify_ninja_availability()" 2>/dev/null \
    || { echo "$NAME: torch in $PY finds no ninja to build FlashInfer's write"; exit 4; }
# torch links the toolkit's libcudart: the one nvcc runs from (a wrapper on PATH can hide it)
export CUDA_HOME="${CUDA_HOME:-$(nvcc --dryrun -c -x cu /dev/null 2>&1 | sed -n 's/^#\$ TOP=\(.*\)\/bin\/\.\.$/\1/p')}"
if [ "${1:-}" = --dry-run ]; then
    # everything but the GPU: FlashInfer's write built for sm90 (about 30 s on 2 cores), fp8kv's side on the CPU
    "$PY" -c "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import gpu_nvfp4 as g; \
g.build(Path(sys.argv[2]), '9.0', Path(sys.argv[3])); k, v = g.inputs(); \
print('fp8kv pages', tuple(g.fp8kv_pages(k, v, *g.SCALES[1], swizzle_v=False).shape))" \
        "$REPO/probes" "$INCLUDE" "$WORK"
    echo "$NAME: ready for a GPU ($(nvcc --version | grep release), CUDA_HOME $CUDA_HOME)"
    exit 0
fi
nvidia-smi --query-gpu=name,compute_cap --format=csv || true
"$PY" "$REPO/probes/gpu_nvfp4.py" --include "$INCLUDE" --out "$OUT/nvfp4-flashinfer-write.json"
