#!/usr/bin/env bash
# Runs every engine probe again and rewrites the golden files under tests/golden/, which the test suite checks
# configs/engines.toml against: a new engine release is one run of this script and a diff. Each engine is built
# from the package index in a venv of its own, bench/.ENGINE-venv (built by probes/ENGINE_venv.sh; never fp8kv's,
# whose torch torch_xla pins); a venv that exists is reused. About 25 GB of venvs in all; the SGLang one (11 GB)
# and the FlashInfer one (7.5 GB) are most of it.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
PY="$ROOT/.venv/bin/python"
cd "$ROOT"

# vLLM and vllm-tpu: their published packages, read without installing them
"$PY" probes/probe_vllm_packages.py

# tpu-inference: its write run on JAX's CPU backend and compiled for TPU v5e and v6e
test -x bench/.tpu-inference-venv/bin/python || bash probes/tpu_inference_venv.sh
bench/.tpu-inference-venv/bin/python probes/probe_tpu_inference.py

# SGLang's releases: each wheel's torch pin and compressed-tensors KV-scale loader, read without installing them
"$PY" probes/probe_sglang_packages.py

# SGLang: its own loader on each fp8kv output format
test -x bench/.sglang-venv/bin/python || bash probes/sglang_venv.sh
"$PY" probes/probe_sglang.py

# SGLang: its NVFP4 KV-cache method's global scales per GPU generation, on a folder calibrated from the bundled text
NVFP4="$(mktemp -d)"
trap 'rm -rf "$NVFP4"' EXIT
.venv/bin/fp8kv calibrate bundled --dataset bundled --kv-dtype nvfp4 --num-samples 8 --seq-len 64 \
    --out "$NVFP4/nvfp4" -q >/dev/null
bench/.sglang-venv/bin/python probes/sglang_nvfp4_loader.py "$NVFP4/nvfp4" --unit-layer 1 \
    --out tests/golden/nvfp4-sglang-0.5.23.json

# SGLang: what of its NVFP4 cache write and read runs on a CPU (its V-scale swizzle, its pure-torch read)
bench/.sglang-venv/bin/python probes/sglang_nvfp4_write.py --out tests/golden/nvfp4-sglang-write-0.5.23.json

# vLLM's CPU build: its own loader through fp8kv load-check
test -x bench/.vllm-venv/bin/python || bash probes/vllm_venv.sh
"$PY" probes/load_check_golden.py

# Both engines' own loaders on every zoo architecture they have, per fp8kv output format (about 10 minutes)
"$PY" probes/probe_loaders.py

# vLLM's CUDA wheel of the CPU build's release: the Python its loader runs, file for file against the CPU wheel's
"$PY" probes/vllm_cuda_python.py

# vLLM's pure-torch NVFP4 reference (its CPU wheel beside torch 2.9.0): the layout, read-back and quantization
test -x bench/.vllm-nvfp4-venv/bin/python || bash probes/vllm_nvfp4_venv.sh
bench/.vllm-nvfp4-venv/bin/python probes/vllm_nvfp4_reference.py --out tests/golden/nvfp4-vllm-0.32.0.json

# FlashInfer at vLLM 0.32.0's pin: where its own code puts sm100's V block scales (its quantize kernel stood in for)
test -x bench/.flashinfer-venv/bin/python || bash probes/flashinfer_venv.sh
bench/.flashinfer-venv/bin/python probes/flashinfer_nvfp4_swizzle.py --out tests/golden/nvfp4-flashinfer-0.7.0.post1.json

git -C "$ROOT" status --short tests/golden
