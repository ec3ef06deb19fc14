"""Build the bundled outlier model: the bundled model with K/V outlier channels and the same function.

    python -m fp8kv.tools.outliers          # rewrites models/bundled/outliers/ (seconds)

Real models carry "massive activations": a few fixed K or V channels hundreds of times larger than
the rest, so their K/V amax lies far beyond e4m3's 448 and unit scales saturate (or, without a
clamp, turn into NaN). The bundled model's K/V amax is 4-10. This script moves a few channels of
three layers out by a power of two and takes the factor back out where the channel is consumed,
so every logit is unchanged:

- K (layers 1 and 3): rows `j` and `j + head_dim/2` of one KV head in `k_proj` times `c`, the same
  rows of every query head of its group in `q_proj` divided by `c`. Llama's RoPE rotates dimension
  `j` with `j + head_dim/2`, so both members of a pair carry the same factor and RoPE commutes with
  it; q·k is unchanged.
- V (layer 2): row `j` of one KV head in `v_proj` times `c`, and the `o_proj` input columns of that
  dimension for every query head of the group divided by `c`.

A power-of-two `c` is exact in bf16 weights and in every product that follows, so the outlier model
computes the same logits as the bundled one (checked by `tests/test_outliers.py`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fp8kv.geometry import AttentionGeometry
from fp8kv.models import BUNDLED_MODEL_DIR, BUNDLED_OUTLIERS_DIR

WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class Outlier:
    """Scale one channel of K (a RoPE pair) or V of one KV head in one layer by `factor` (a power of two)."""

    layer: int
    kind: str  # "k" or "v"
    kv_head: int
    dim: int  # for K the first of the RoPE pair (dim, dim + head_dim/2), dim < head_dim/2
    factor: float


# Channels with the largest |k| / |v| of the bundled model in these layers (calibration split),
# scaled so the layer's amax lands beyond 448: K of layer 1 at ~1000, V of layer 2 at ~770, and
# K of layer 3 just past 448 (~540), where a tight margin decides between clamp and NaN.
OUTLIERS = (
    Outlier(layer=1, kind="k", kv_head=0, dim=9, factor=128.0),
    Outlier(layer=2, kind="v", kv_head=0, dim=22, factor=128.0),
    Outlier(layer=3, kind="k", kv_head=0, dim=9, factor=64.0),
)


def add_outliers(weights: dict[str, torch.Tensor], geometry: AttentionGeometry,
                 outliers: tuple[Outlier, ...] = OUTLIERS) -> dict[str, torch.Tensor]:
    """A copy of `weights` (a Llama state dict) with each outlier channel scaled in and compensated."""
    out = {name: tensor.clone() for name, tensor in weights.items()}
    d, group = geometry.head_dim, geometry.num_heads // geometry.num_kv_heads
    for o in outliers:
        assert o.factor == 2.0 ** round(torch.tensor(o.factor).log2().item()), "powers of two keep bf16 exact"
        prefix = f"model.layers.{o.layer}.self_attn."
        query_heads = range(o.kv_head * group, (o.kv_head + 1) * group)
        if o.kind == "k":
            assert o.dim < d // 2, "K channels are named by the first dimension of their RoPE pair"
            dims = (o.dim, o.dim + d // 2)
            _scale_rows(out[prefix + "k_proj.weight"], [o.kv_head * d + j for j in dims], o.factor)
            _scale_rows(out[prefix + "q_proj.weight"], [h * d + j for h in query_heads for j in dims], 1 / o.factor)
        else:
            _scale_rows(out[prefix + "v_proj.weight"], [o.kv_head * d + o.dim], o.factor)
            columns = [h * d + o.dim for h in query_heads]
            out[prefix + "o_proj.weight"][:, columns] /= o.factor
    return out


def _scale_rows(weight: torch.Tensor, rows: list[int], factor: float) -> None:
    weight[rows] *= factor  # [out_features, in_features]: a row is one output channel


def build(source: Path = BUNDLED_MODEL_DIR, out: Path = BUNDLED_OUTLIERS_DIR) -> Path:
    """Write the outlier model (weights, config, tokenizer) into `out`, replacing it atomically."""
    geometry = AttentionGeometry.from_dir(source)
    weights = add_outliers(load_file(source / WEIGHTS), geometry)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    for path in sorted(source.iterdir()):
        if path.is_file() and path.name != WEIGHTS:
            shutil.copyfile(path, staging / path.name)
    save_file(weights, str(staging / WEIGHTS), metadata={"format": "pt"})
    for path in (staging, *staging.iterdir()):  # mkdtemp creates an owner-only folder
        path.chmod(0o755 if path.is_dir() else 0o644)
    retired = out.with_name(f".{out.name}.old")
    if out.exists():
        out.rename(retired)
    staging.rename(out)
    shutil.rmtree(retired, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fp8kv.models import BUNDLED_HELDOUT_TEXT
    from fp8kv.tools.train import perplexity

    parser = argparse.ArgumentParser(prog="python -m fp8kv.tools.outliers", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=BUNDLED_OUTLIERS_DIR)
    args = parser.parse_args(argv)
    out = build(out=args.out)
    texts = [json.loads(line)["text"] for line in BUNDLED_HELDOUT_TEXT.read_text(encoding="utf-8").splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(out)
    for name, path in (("bundled", BUNDLED_MODEL_DIR), ("bundled-outliers", out)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        print(f"{name}: held-out perplexity {perplexity(model, tokenizer, texts):.4f} ({len(texts)} records)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
