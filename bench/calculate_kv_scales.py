"""vLLM's removed `--calculate-kv-scales` rule against fp8kv's static scales, on held-out text.

vLLM's dynamic rule set each layer's scales once, from the first forward it ran: k_scale = max|K| / 200,
v_scale = max|V| / 100 (its K_SCALE_CONSTANT and V_SCALE_CONSTANT), and kept them. fp8kv's scales are
max|x| over the calibration text x headroom / 448. This script computes both on SmolLM2-135M-Instruct
(the `demo` extra's GGUF) through fp8kv.api, the dynamic rule from the first calibration sample alone (one
prompt, as a first request would be), and reports, per layer, the largest |x|/scale each gives on the
bundled held-out text: past 448 an e4m3 cache clips (or, on an engine that does not clamp, stores NaN).

    .venv/bin/python bench/calculate_kv_scales.py [--model smollm2] [--samples 16] [--seq-len 256]

Prints a table and writes bench/results/calculate_kv_scales.json.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fp8kv import api
from fp8kv.checkpoint.locate import resolve_model
from fp8kv.console import markdown_table
from fp8kv.data import DataRequest, load_calibration_data, make_batches, pad_id
from fp8kv.fp8 import FP8_MAX
from fp8kv.models import BUNDLED_CALIBRATION_TEXT, BUNDLED_HELDOUT_TEXT

import common  # bench/common.py

# vLLM's divisors for its dynamic scales (envs.K_SCALE_CONSTANT, envs.V_SCALE_CONSTANT)
DYNAMIC_DIVISORS = (200.0, 100.0)


def layer_amax(statistics: api.KVStatistics) -> torch.Tensor:
    """max |x| per layer and K/V, over heads: float32 [num_layers, 2]."""
    return statistics.amax.amax(dim=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--headroom", type=float, default=api.CalibrationRequest.headroom)
    args = parser.parse_args()

    folder = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto").eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    request = DataRequest(str(BUNDLED_CALIBRATION_TEXT), num_samples=args.samples, seq_len=args.seq_len)
    calibration = load_calibration_data(request, tokenizer).samples
    held_out = load_calibration_data(DataRequest(str(BUNDLED_HELDOUT_TEXT), num_samples=args.samples,
                                                 seq_len=args.seq_len), tokenizer).samples
    pad = pad_id(tokenizer)

    first = layer_amax(api.observe_model(model, make_batches(calibration[:1], 1, pad)))
    static = layer_amax(api.observe_model(model, make_batches(calibration, 4, pad)))
    seen = layer_amax(api.observe_model(model, make_batches(held_out, 4, pad)))
    fp8_max = FP8_MAX["fp8_e4m3"]
    dynamic_scale = first / torch.tensor(DYNAMIC_DIVISORS)
    static_scale = static * args.headroom / fp8_max
    rows, layers = [], []
    for layer in range(first.shape[0]):
        entry: dict[str, float] = {"layer": layer}
        for kind, index in (("k", 0), ("v", 1)):
            entry[f"{kind}_dynamic_ratio"] = float(seen[layer, index] / dynamic_scale[layer, index])
            entry[f"{kind}_fp8kv_ratio"] = float(seen[layer, index] / static_scale[layer, index])
        layers.append(entry)
        rows.append([str(layer)] + [f"{entry[key]:.0f}" for key in ("k_dynamic_ratio", "k_fp8kv_ratio", "v_dynamic_ratio",
                                                               "v_fp8kv_ratio")])
    past = {rule: sum(entry[f"{kind}_{rule}_ratio"] > fp8_max for entry in layers for kind in "kv")
            for rule in ("dynamic", "fp8kv")}
    print(markdown_table(["layer", "K: dynamic", "K: fp8kv", "V: dynamic", "V: fp8kv"], rows))
    print(f"\nlargest held-out |x|/scale; past {fp8_max:g} clips: dynamic rule {past['dynamic']} of "
          f"{2 * len(layers)} tensors, fp8kv {past['fp8kv']}")
    common.write_results("calculate_kv_scales", layers, args, calibration_samples=len(calibration),
                         heldout_samples=len(held_out), dynamic_divisors=DYNAMIC_DIVISORS,
                         first_sample_tokens=len(calibration[0]), past_fp8_max=past)


if __name__ == "__main__":
    main()
