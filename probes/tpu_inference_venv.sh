#!/usr/bin/env bash
# Builds bench/.tpu-inference-venv: tpu-inference and the JAX it runs on, for probes/probe_tpu_inference.py.
# jax 0.11.2 needs Python 3.12 and fp8kv's venv pins jax 0.7.1 (torch_xla's), so the two cannot share one.
# tpu-inference goes in without its dependencies: they are vLLM and its stack (gigabytes), and the probe only
# reads the package's files and runs its quantization module on JAX. libtpu is there to compile for TPU
# topologies ahead of time (no TPU needed), never to run on one.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TPU_INFERENCE_VENV:-$REPO/bench/.tpu-inference-venv}"
TPU_INFERENCE_VERSION="${TPU_INFERENCE_VERSION:-0.32.0}"
JAX_VERSION="${JAX_VERSION:-0.11.2}"
LIBTPU_VERSION="${LIBTPU_VERSION:-0.0.48}"
PY="$VENV/bin/python"
# libtpu alone is over 1 GB: a cached copy of it beside the venv is waste.
export PIP_NO_CACHE_DIR=1

test -x "$PY" || "${PYTHON:-/root/.pyenv/versions/3.12.1/bin/python}" -m venv "$VENV"
"$PY" -m pip install --quiet --upgrade pip
# jax brings numpy, ml_dtypes, opt_einsum and scipy; safetensors writes the golden bytes. They go in before
# tpu-inference, so pip has no reason to list tpu-inference's vLLM requirements as missing.
"$PY" -m pip install --quiet "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION" "libtpu==$LIBTPU_VERSION" safetensors
# The wheel is downloaded first and installed from the file: pip records its sha256, which the probe reports.
WHEELS="$VENV/wheels"
"$PY" -m pip download --quiet --no-deps "tpu-inference==$TPU_INFERENCE_VERSION" -d "$WHEELS"
WHEEL="$(ls "$WHEELS"/tpu_inference-"$TPU_INFERENCE_VERSION"-*.whl)"
"$PY" -m pip install --quiet --no-deps "$WHEEL"
"$PY" -c "import jax, jaxlib; from importlib.metadata import version as v; \
print('tpu-inference', v('tpu-inference'), 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'libtpu', v('libtpu'))"
