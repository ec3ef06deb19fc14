"""Dump vLLM's prompt log-probabilities for a conformance pack, as `fp8kv conformance check` reads them.

Runs in a Python with vLLM (its own venv: vLLM pins another torch than fp8kv's), on the machine whose
engine is checked:

    VLLM_ATTENTION_BACKEND=FLASH_ATTN python probes/vllm_logprobs.py PACK --out ENGINE.jsonl

vLLM loads PACK/model with an fp8 KV cache and scores every prompt of PACK/pack.json (its token ids,
no sampling); each output line is {"id": PROMPT_ID, "logprobs": [...]}: the log-probability of every
prompt token after the first, null where vLLM gave NaN/inf. The pack's layout is
fp8kv.conformance.pack's (read here as plain JSON: fp8kv is not importable beside vLLM's torch).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kv-cache-dtype", default="fp8", help="vLLM's --kv-cache-dtype (fp8 is e4m3).")
    parser.add_argument("--model", type=Path, help="Serve this checkpoint instead of PACK/model (the same "
                        "tokenizer): the source model with --kv-cache-dtype auto gives `conformance check --bf16-answers` "
                        "(PACK/model would keep an fp8 cache: its config declares one).")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    pack = json.loads((args.pack / "pack.json").read_text())
    prompts = [(p["id"], [int(t) for t in p["token_ids"]]) for p in pack["prompts"]]
    llm = LLM(model=str(args.model or args.pack / "model"), kv_cache_dtype=args.kv_cache_dtype, enforce_eager=True,
              max_model_len=max(len(ids) for _, ids in prompts) + 8,
              gpu_memory_utilization=args.gpu_memory_utilization, seed=0)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)  # 0: the prompt token's own
    outputs = llm.generate([{"prompt_token_ids": ids} for _, ids in prompts], params)
    lines = []
    for (pid, ids), output in zip(prompts, outputs):
        per_token = output.prompt_logprobs[1:]  # the first token has none
        values = [_finite(entry[token].logprob) for entry, token in zip(per_token, ids[1:])]
        lines.append(json.dumps({"id": pid, "logprobs": values}))
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, args.out)
    backend = os.environ.get("VLLM_ATTENTION_BACKEND", "vLLM's default")
    print(f"wrote {args.out}: {len(lines)} prompts, attention backend {backend}")


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


if __name__ == "__main__":
    main()
