"""Does `fp8kv conformance check` still name each behaviour when the engine computes in another arithmetic?

A real engine does not compute as fp8kv's reference does (float32 attention over the model's weights). For
each behaviour of a pack (correct and every bug) and each arithmetic below, fp8kv's runtime answers the
pack's prompts with that behaviour in that arithmetic, and `check` names what it is nearest to:
- `xla-reference`: torch_xla's reference roundings (K/V and attention probabilities in the query's dtype);
- `pallas-kernel`: the TPU kernel's (raw fp8 K/V, scales applied after QK and PV);
- `bf16 weights`: the model in bf16 with the reference roundings (a float32 pack's model only).
Each is checked twice: alone, and with the same arithmetic's answers under a bf16 cache (`--bf16-answers`), which
measure the arithmetic's own share of every distance and decide whether the match is close.
Prints a table (the match, its distance, the next behaviour's, the arithmetic's share, close) and writes
bench/results/conformance_arithmetic.json.

    python bench/conformance_arithmetic.py PACK [PACK ...]     (PACK: `fp8kv conformance reference DIR --out PACK`)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from fp8kv.checkpoint.reader import read_kv_scales
from fp8kv.conformance.pack import MODEL_DIR, read_pack, write_answers
from fp8kv.conformance.request import behaviour_engine
from fp8kv.conformance.run import bf16_cache_logprobs, check, prompt_logprobs
from fp8kv.runtime.runner import load_model

import common  # bench/common.py

# name: (weights dtype, None for the pack's own; torch attention numerics)
ARITHMETICS = {"xla-reference": (None, "xla-reference"), "pallas-kernel": (None, "pallas-kernel"),
               "bf16 weights": (torch.bfloat16, "xla-reference")}


def run_pack(pack_dir: Path, folder: Path) -> list[dict]:
    pack, _ = read_pack(pack_dir)
    model_dir = pack_dir / MODEL_DIR
    scales = read_kv_scales(model_dir).scales
    assert scales is not None  # a pack's model always holds its scales
    rows = []
    native = load_model(model_dir, torch.device("cpu"))
    for arithmetic, (dtype, numerics) in ARITHMETICS.items():
        if dtype == native.dtype:  # a bf16 pack's own weights: the reference roundings' rows already say it
            continue
        model = native if dtype is None else load_model(model_dir, torch.device("cpu"), dtype)
        bf16_cache = bf16_cache_logprobs(model_dir, pack.prompts, "cpu", model, attention_numerics=numerics)
        bf16_path, answers_path = folder / "bf16.jsonl", folder / "answers.jsonl"
        write_answers(bf16_path, {pid: values.tolist() for pid, values in bf16_cache.items()})
        for behaviour in pack.behaviours:
            answers = prompt_logprobs(model_dir, scales, pack.prompts, behaviour_engine(behaviour), "cpu", model,
                                      attention_numerics=numerics)
            write_answers(answers_path, {pid: values.tolist() for pid, values in answers.items()})
            result = check(pack_dir, answers_path)
            judged = check(pack_dir, answers_path, bf16_path)
            ranked = sorted(result.distances.items(), key=lambda item: item[1])
            rows.append({"pack": str(pack_dir), "model_dtype": str(model.dtype).removeprefix("torch."),
                         "arithmetic": arithmetic, "behaviour": behaviour, "match": result.match,
                         "distance": result.distances[behaviour], "next": ranked[1][0], "next_distance": ranked[1][1],
                         "separation": pack.separation, "close_alone": result.close,
                         "own_arithmetic": judged.arithmetic, "close": judged.close})
    return rows


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("packs", type=Path, nargs="+")
    args = options.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:  # the answers `check` reads, kept out of the packs' folders
        for pack_dir in args.packs:
            rows += run_pack(pack_dir, Path(tmp))
    print(f"{'pack':18} {'arithmetic':14} {'behaviour':16} {'named':16} {'distance':>9} {'own arith':>9} "
          f"{'close':>11}  next (distance)")
    for r in rows:
        named = r["match"] if r["match"] == r["behaviour"] else f"{r['match']} (WRONG)"
        close = f"{'yes' if r['close_alone'] else 'no'} / {'yes' if r['close'] else 'no'}"
        print(f"{Path(r['pack']).name[:18]:18} {r['arithmetic']:14} {r['behaviour']:16} {named:16} "
              f"{r['distance']:>9.4f} {r['own_arithmetic']:>9.4f} {close:>11}  {r['next']} ({r['next_distance']:.4f})")
    wrong = sum(r["match"] != r["behaviour"] for r in rows)
    print(f"{len(rows) - wrong} of {len(rows)} named correctly; close alone {sum(r['close_alone'] for r in rows)}, "
          f"with the arithmetic measured {sum(r['close'] for r in rows)} (of {len(rows)})")
    args.packs = [str(p) for p in args.packs]
    common.write_results("conformance_arithmetic", rows, args, wrong=wrong)


if __name__ == "__main__":
    main()
