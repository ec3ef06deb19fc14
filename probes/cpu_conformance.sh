#!/usr/bin/env bash
# A released engine checked on this machine: vLLM's CPU build, with an fp8 KV cache, against fp8kv's models.
#   1. bytes: vLLM's own cache-write op against the `vllm-cpu` engine model (probes/vllm_cpu_write.py);
#   2. behaviour: SmolLM2 calibrated, a conformance pack written, vLLM scoring its prompts, `fp8kv conformance
#      check` naming the behaviour vLLM's answers match (vLLM 0.32's CPU conversion rounds toward zero, so
#      `truncating-cast` is the expected match, not `correct`);
#      with vLLM's answers under a bf16 cache beside them (`--bf16-answers`): how far vLLM's own arithmetic lies
#      from fp8kv's, whatever the fp8 write does.
# Needs an x86 CPU with AVX-512 or AMX (vLLM's CPU fp8 cache refuses others) and bench/.vllm-venv (built here
# by probes/vllm_venv.sh when missing; VLLM_PY overrides). About 3.5 minutes on 2 cores once the venv exists.
# Results in $OUT (default bench/results): vllm_cpu_write.json, vllm-cpu.jsonl, vllm-cpu-bf16.jsonl,
# conformance-vllm-cpu.json.
#   run: bash probes/cpu_conformance.sh
set -euo pipefail
NAME=cpu-conformance
source "$(dirname "$0")/../bench/machine_env.sh"
VLLM_PY="${VLLM_PY:-$REPO/bench/.vllm-venv/bin/python}"
test -x "$VLLM_PY" || bash "$REPO/probes/vllm_venv.sh"
grep -qw -e avx512f -e amx_tile /proc/cpuinfo || { echo "this CPU has neither AVX-512 nor AMX: vLLM refuses an fp8 cache" >&2; exit 4; }
# the engine core in this process, and a small cache: the prompts are short
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1

"$VLLM_PY" "$REPO/probes/vllm_cpu_write.py" --out "$OUT/vllm_cpu_write.json"

"$PY" -m fp8kv calibrate smollm2 --out "$WORK/calibrated" --dataset bundled --num-samples 16 --seq-len 256 --quiet
"$PY" -m fp8kv conformance reference "$WORK/calibrated" --out "$WORK/pack" --mode copy
"$VLLM_PY" "$REPO/probes/vllm_logprobs.py" "$WORK/pack" --out "$OUT/vllm-cpu.jsonl"
# the same prompts with a bf16 cache, on the pack's source model: vLLM's arithmetic alone
SOURCE="$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["source"]["path"])' "$WORK/calibrated/fp8kv.json")"
"$VLLM_PY" "$REPO/probes/vllm_logprobs.py" "$WORK/pack" --model "$SOURCE" --kv-cache-dtype auto --out "$OUT/vllm-cpu-bf16.jsonl"
status=0
"$PY" -m fp8kv conformance check "$WORK/pack" "$OUT/vllm-cpu.jsonl" --bf16-answers "$OUT/vllm-cpu-bf16.jsonl" || status=$?
"$PY" -m fp8kv conformance check "$WORK/pack" "$OUT/vllm-cpu.jsonl" --bf16-answers "$OUT/vllm-cpu-bf16.jsonl" --json \
    > "$OUT/conformance-vllm-cpu.json" || true
# exit 3 means "not correct", which is this engine's measured behaviour; anything else is an error
test "$status" -eq 0 -o "$status" -eq 3
