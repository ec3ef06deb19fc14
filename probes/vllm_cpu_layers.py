"""What vLLM CPU's `amx` attention computes inside a real run of a real model, written as a golden file.

Runs in vLLM's venv, with fp8kv installed there (probes/run_vllm_cpu.sh does both):

    bench/.vllm-venv/bin/python probes/vllm_cpu_layers.py

SmolLM2-135M-Instruct in bfloat16 (the package index's GGUF, dequantized by fp8kv) serves the first prompt of
runs/smollm2-generated-heldout-ids.jsonl with an fp8 cache at unit scales, where the most small terms meet the
AMX tiles' flush. The engine's cache-write and attention ops are wrapped in place to keep, at each of LAYERS,
what the prefill handed them and what the attention returned: the K and V entering the write and the query, all
bf16, and the output. KV heads attend independently, so the file keeps the first KV head and its query heads:
probed/smollm2-amx-layers.safetensors, with the engine, the machine and the path its layers ran in the metadata.
A CPU without AMX tiles runs another path: said in one line, exit status 4, nothing written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from vllm_cpu_runs import CANNOT_RUN, IDS, OUT, isa_on_worker, machine, missing_flags

PROMPTS = IDS["smollm2"]
LAYERS = (0, 29)  # the first, where most values sit near the flush, and the last


def capture(model: Path, ids: list[int]) -> tuple[dict[str, Any], list[str], float]:
    """The wrapped ops' records of one prefill of `ids`: tensors by name, the path the layers ran, the softmax
    scale."""
    import torch
    import vllm._custom_ops as ops
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model), dtype="bfloat16", kv_cache_dtype="fp8", enforce_eager=True,
              max_model_len=len(ids) + 8, max_num_seqs=1, seed=0)
    layers = llm.llm_engine.model_config.hf_config.num_hidden_layers
    kept: dict[str, Any] = {}
    calls = {"write": 0, "attend": 0}
    write, attend = ops.cpu_attn_reshape_and_cache, ops.cpu_attention_with_kv_cache

    def wrapped_write(key, value, *args, **kwargs):
        layer = calls["write"] % layers
        calls["write"] += 1
        if layer in LAYERS:
            kept[f"k{layer}"], kept[f"v{layer}"] = key[:, :1].clone(), value[:, :1].clone()
        return write(key, value, *args, **kwargs)

    def wrapped_attend(**kwargs):
        layer = calls["attend"] % layers
        calls["attend"] += 1
        result = attend(**kwargs)
        if layer in LAYERS:
            group = kwargs["query"].shape[1] // kwargs["key_cache"].shape[1]
            kept[f"q{layer}"] = kwargs["query"][:, :group].clone()
            kept[f"out{layer}"] = kwargs["output"][:, :group].clone()
            kept["scales"] = torch.tensor([kwargs["scale"], kwargs["k_scale"], kwargs["v_scale"]])
        return result

    ops.cpu_attn_reshape_and_cache, ops.cpu_attention_with_kv_cache = wrapped_write, wrapped_attend
    try:
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    finally:
        ops.cpu_attn_reshape_and_cache, ops.cpu_attention_with_kv_cache = write, attend
    if calls["write"] != layers or kept["q0"].shape[0] != len(ids):  # one token sampled: no decode step runs
        raise SystemExit(f"expected one prefill of {len(ids)} tokens, saw {calls}")
    isa = sorted({path for worker in llm.collective_rpc(isa_on_worker) for path in worker})
    return kept, isa, float(kept["scales"][0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT / "smollm2-amx-layers.safetensors")
    args = parser.parse_args()
    lacking = missing_flags("amx")
    if lacking:
        print(f"vllm-cpu amx: this CPU lacks {', '.join(lacking)}; vLLM runs another path here, nothing probed")
        sys.exit(CANNOT_RUN)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the wrapped ops run in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    import vllm
    from safetensors.torch import save_file

    from fp8kv.checkpoint.locate import resolve_model

    ids = json.loads(PROMPTS.read_text().splitlines()[0])["ids"]
    kept, isa, sm_scale = capture(resolve_model("smollm2"), ids)
    if isa != ["amx"]:
        print(f"vllm-cpu amx: vLLM ran {isa} for a bfloat16 model here, nothing written")
        sys.exit(CANNOT_RUN)
    meta = {"engine": f"vllm-cpu {vllm.__version__}", "torch": torch.__version__, **machine(), "attention_isa": "amx",
            "model": "smollm2 (bfloat16)", "prompt": f"{PROMPTS.name} line 1, {len(ids)} tokens", "layers": list(LAYERS),
            "kv_cache_dtype": "fp8", "sm_scale": sm_scale,
            "how": "the K/V entering cpu_attn_reshape_and_cache and the query and output of cpu_attention_with_kv_cache "
                   "in the prefill, first KV head and its query heads: k{layer}, v{layer} [tokens, 1, dim], "
                   "q{layer}, out{layer} [tokens, group, dim]; scales = (sm_scale, k_scale, v_scale)"}
    tmp = args.out.with_name(args.out.name + ".tmp")
    save_file({name: t.contiguous() for name, t in kept.items()}, str(tmp), metadata={"meta": json.dumps(meta)})
    os.replace(tmp, args.out)
    print(f"vllm-cpu amx: layers {list(LAYERS)} of one prefill written to {args.out}")


if __name__ == "__main__":
    main()
