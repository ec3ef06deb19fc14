"""verify's bf16 runtime against transformers' own forward, per factory architecture (the fidelity floor).

    .venv/bin/python bench/bench_fidelity.py [--samples 4] [--seq-len 48]

Each factory architecture (float32 and bf16 weights) and the bundled trained model: the mean and
max KL(transformers || runtime bf16 cache) over held-out samples and the model's own noise
(transformers with another attention implementation), as `verify.fidelity` measures them. Prints a
table and writes bench/results/fidelity.json; NOISE_FACTOR and MIN_BOUND are set above the largest.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import common  # bench/common.py
from fp8kv.json_fields import to_json_value
from fp8kv.models import BUNDLED_MODEL_DIR
from fp8kv.tools.factory import ARCHITECTURES, make_checkpoint, make_tokenizer
from fp8kv.runtime.runner import PagedModelRunner
from fp8kv.verify import fidelity


def measure(name: str, weights: str, path: Path, samples: list[list[int]], args: argparse.Namespace) -> dict:
    runner = PagedModelRunner(path, device=args.device, cache_dtype="bf16", max_model_len=args.seq_len,
                              max_num_seqs=len(samples))
    result = fidelity.measure_fidelity(runner, samples, num_samples=len(samples))
    row = {"model": name, "weights": weights, **to_json_value(result)}
    noise = result.noise if result.noise is not None else float("nan")  # nan: one attention implementation
    print(f"{name:<14}{weights:<10}{result.kl_mean:>11.2e}{result.kl_max:>11.2e}{noise:>11.2e}"
          f"{result.bound:>11.1e}  {'yes' if result.reproduces else 'NO'}")
    return row


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--samples", type=int, default=4)
    options.add_argument("--seq-len", type=int, default=256)
    options.add_argument("--device", default="cpu")
    args = options.parse_args()
    from pydoc_data.topics import topics
    from transformers import AutoTokenizer

    texts = [topics[k] for k in sorted(topics)[40 : 40 + args.samples]]
    bundled_tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR)
    print(f"{'model':<14}{'weights':<10}{'kl_mean':>11}{'kl_max':>11}{'noise':>11}{'bound':>11}  reproduces")
    rows = [measure("bundled", "bfloat16", BUNDLED_MODEL_DIR,
                    [bundled_tokenizer(t)["input_ids"][: args.seq_len] for t in texts], args)]
    tokenizer = make_tokenizer(512)
    samples = [tokenizer(t)["input_ids"][: args.seq_len] for t in texts]
    with tempfile.TemporaryDirectory() as root:
        for arch in ARCHITECTURES:
            for dtype in (torch.float32, torch.bfloat16):
                weights = str(dtype).removeprefix("torch.")
                path = make_checkpoint(arch, Path(root) / f"{arch}-{weights}", dtype=dtype)
                rows.append(measure(arch, weights, path, samples, args))
    noisy = [r["kl_mean"] / r["noise"] for r in rows if (r["noise"] or 0) * fidelity.NOISE_FACTOR > fidelity.MIN_BOUND]
    print(f"largest runtime / noise where the noise sets the bound {max(noisy, default=0):.2f} "
          f"(NOISE_FACTOR {fidelity.NOISE_FACTOR}); largest mean KL on factory models "
          f"{max(r['kl_mean'] for r in rows[1:]):.1e} (MIN_BOUND {fidelity.MIN_BOUND:.0e})")
    common.write_results("fidelity", rows, args, noise_factor=fidelity.NOISE_FACTOR, min_bound=fidelity.MIN_BOUND)


if __name__ == "__main__":
    main()
