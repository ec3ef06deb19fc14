"""Runtime benchmark: prefill/decode tokens/s with an fp8 vs a bf16 KV cache side by side, cache bytes, compiles.

    PJRT_DEVICE=CPU .venv/bin/python bench/bench_runtime.py [--devices cpu,xla-cpu] [--backends auto,torch]
        [--out bench/results/runtime.json]

Each (device, attention backend) runs bf16 then fp8 in one process and prints fp8/bf16 decode tokens/s.
On XLA, "auto" is torch_xla's ragged_paged_attention (its reference off TPU) and "torch" is fp8kv's
vectorized attention. Timings exclude the first (warm-up) pass, which on XLA holds the compiles of the
two new buckets (prefill, decode); compiles in the timed pass are reported apart.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402

from fp8kv.tools.factory import make_checkpoint  # noqa: E402
from fp8kv.runtime.runner import PagedModelRunner  # noqa: E402

MODEL = dict(num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=4, head_dim=32, sliding_window=None)


def _compiles() -> int:
    try:
        import torch_xla.debug.metrics as met
    except ImportError:
        return 0
    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


def _workload(runner: PagedModelRunner, prompts: list[list[int]], decode_steps: int) -> tuple[float, float]:
    """Seconds for one batched prefill and for `decode_steps` batched decode steps."""
    seqs = [runner.start()[0] for _ in prompts]
    start = time.perf_counter()
    runner.step(list(zip(seqs, prompts)))
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(decode_steps):
        runner.step([(s, [7]) for s in seqs])
    decode = time.perf_counter() - start
    for s in seqs:
        runner.free(s)
    return prefill, decode


def bench_one(model_dir: Path, device: str, backend: str, cache_dtype: str, batch: int, prompt_len: int,
              steps: int) -> dict:
    runner = PagedModelRunner(
        model_dir, device=device, cache_dtype=cache_dtype, page_size=16, max_model_len=prompt_len + steps + 16,
        max_num_seqs=batch, k_scales=None, v_scales=None, attention_backend=backend,
    )
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, 500, (batch, prompt_len), generator=generator).tolist()
    before = _compiles()
    _workload(runner, prompts, steps)  # warm-up: compiles on XLA
    warm = _compiles()
    prefill, decode = _workload(runner, prompts, steps)
    cache = runner.cache
    tokens = prompt_len + steps
    pages_per_seq = -(-tokens // cache.page_size)
    page_bytes = cache.pages[0][0].numel() * cache.pages[0].element_size() * len(cache.kv_layers)
    return {
        "device": device,
        "attention": runner.attention,
        "cache_dtype": cache_dtype,
        "prefill_tok_s": batch * prompt_len / prefill,
        "decode_tok_s": batch * steps / decode,
        "cache_bytes_per_token": cache.bytes_per_token(),
        "cache_bytes_per_token_paged": pages_per_seq * page_bytes / tokens,
        "head_dim_padded": cache.head_dim_padded,
        "compiles_warmup": warm - before,
        "compiles_timed": _compiles() - warm,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="cpu,xla-cpu")
    parser.add_argument("--backends", default="auto,torch", help="attention backends tried on XLA devices")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=20)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "runtime.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_checkpoint("llama", Path(tmp) / "llama", **MODEL)
        rows = []
        for device in args.devices.split(","):
            for backend in args.backends.split(",") if device in ("xla-cpu", "tpu") else ["auto"]:
                pair = [bench_one(model_dir, device, backend, dtype, args.batch, args.prompt_len, args.decode_steps)
                        for dtype in ("bf16", "fp8_e4m3")]
                pair[1]["fp8_over_bf16_decode"] = pair[1]["decode_tok_s"] / pair[0]["decode_tok_s"]
                rows += pair
    header = (f"{'device':8} {'attention':33} {'cache':9} {'prefill tok/s':>13} {'decode tok/s':>12} {'fp8/bf16':>8} "
              f"{'B/token':>8} {'B/token paged':>13} {'compiles':>8}")
    print(header)
    for r in rows:
        ratio = f"{r['fp8_over_bf16_decode']:.2f}x" if "fp8_over_bf16_decode" in r else ""
        print(
            f"{r['device']:8} {r['attention']:33} {r['cache_dtype']:9} {r['prefill_tok_s']:13.0f} "
            f"{r['decode_tok_s']:12.1f} {ratio:>8} {r['cache_bytes_per_token']:8.0f} "
            f"{r['cache_bytes_per_token_paged']:13.0f} {r['compiles_warmup']:>4}+{r['compiles_timed']}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"model": {"arch": "llama", **MODEL}, "batch": args.batch, "prompt_len": args.prompt_len,
               "decode_steps": args.decode_steps, "torch": torch.__version__, "rows": rows}
    tmp_path = out.with_suffix(".json.tmp")
    tmp_path.write_text(json.dumps(payload, indent=2) + "\n")
    tmp_path.replace(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
