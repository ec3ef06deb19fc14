"""How far apart two bf16 KV caches' answers lie: vLLM's and fp8kv's runtime, on a conformance pack's prompts.

The distances `fp8kv conformance check` reports include the engine's own arithmetic (its bf16 matmuls and
attention in another order than fp8kv's), whatever its fp8 write does. This measures that part alone: vLLM
serving the pack's source model with a bf16 cache (`bench/vllm_logprobs.py PACK --model SOURCE
--kv-cache-dtype auto`) against fp8kv's runtime with a bf16 cache on SOURCE, in the distance `check` uses.

    python bench/conformance_floor.py PACK SOURCE VLLM_BF16.jsonl [--out FLOOR.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fp8kv.conformance.pack import read_answers, read_pack
from fp8kv.conformance.run import distance, runner_logprobs
from fp8kv.runtime.runner import PagedModelRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack", type=Path)
    parser.add_argument("source", type=Path, help="The model the engine served: the pack's source, without scales.")
    parser.add_argument("answers", type=Path, help="The engine's answers with a bf16 cache.")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    pack, _ = read_pack(args.pack)
    runner = PagedModelRunner(args.source, device="cpu", cache_dtype="bf16",
                              max_model_len=max(len(p.token_ids) for p in pack.prompts), max_num_seqs=len(pack.prompts))
    floor = distance(read_answers(args.answers, pack), runner_logprobs(runner, pack.prompts))
    print(f"bf16 caches, engine against fp8kv's runtime: mean |delta logprob| {floor:.4f}")
    if args.out:
        args.out.write_text(json.dumps({"pack": str(args.pack), "floor": floor}) + "\n")


if __name__ == "__main__":
    main()
