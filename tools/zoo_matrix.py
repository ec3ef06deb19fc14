"""Judge fp8kv on a tiny checkpoint of one transformers architecture: the zoo test and the docs/architectures.md table.

The loader is the one calibration uses (`AutoModelForCausalLM`, or `AutoModelForImageTextToText` for
vision-language wrappers).

For each architecture: fp8kv accepts or refuses its config (refusal: one `Fp8kvError` line naming
the feature); an accepted one is built tiny, calibrated, its scales compared with the K/V amax that
transformers' own `DynamicCache` stores after a forward with `use_cache=True` (one sample per
forward, as the calibration batches them), and the output folder is loaded back with
`AutoModelForCausalLM.from_pretrained`. Multi-head latent attention layers cache one latent vector,
not K and V: they are compared with `latent_cache_amax`, read from the model's forward without a cache.
`judge_and_verify` then runs `fp8kv verify` on it, briefly (`verify_outcome`: its verdict, a one-line
refusal, or a crash, and the fidelity KL it measured).

    python -m fp8kv.tools.zoo_matrix            # prints the docs/architectures.md table for every architecture
    python -m fp8kv.tools.zoo_matrix llama gpt2  # only these
    python -m fp8kv.tools.zoo_matrix --layerwise llama jamba   # layer by layer against the whole model
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from fp8kv.errors import Fp8kvError
from fp8kv.tools.zoo import causal_lm_types, make_zoo_checkpoint, make_zoo_config

# Calibration data of the matrix: short records of Python's documentation (no download).
NUM_SAMPLES, SEQ_LEN = 3, 48
# "within tolerance": amax within one bf16 step (2**-8 relative) of the cache's; anything else fails.
BF16_STEP = 2.0**-8
# A representative subset, run by default (FP8KV_ZOO=all runs every architecture).
REPRESENTATIVE = (
    "llama", "gpt2", "gpt_neox", "falcon", "stablelm", "qwen3", "gemma3_text", "mixtral", "olmoe",
    "qwen2_moe", "jamba", "bamba", "deepseek_v3", "bart", "mamba", "llava", "gemma4_text", "minimax",
    "zamba2", "nemotron_h", "inkling_text", "xlnet",
)
# Layer by layer against the whole model: the usual layouts, GPT-2's `h`, BERT's `encoder.layer`, hybrids,
# vision-language wrappers, MoE.
LAYERWISE = ("llama", "gpt2", "bert", "gemma3_text", "mixtral", "jamba", "bamba", "falcon_h1", "qwen3_next", "llava",
             "idefics3", "gemma4_text")
EXACT, TOLERANCE, REFUSED, FAILING = "exact", "within tolerance", "refused", "failing"


@dataclass(frozen=True)
class ZooResult:
    """What happened to one architecture: `status` is one of EXACT, TOLERANCE, REFUSED, FAILING."""

    model_type: str
    status: str
    detail: str
    load_error: str | None = None  # why transformers cannot load fp8kv's output (None: it loads)
    verify: VerifyOutcome | None = None  # `fp8kv verify` on the output (None: not run)


def corpus(folder: Path) -> str:
    """A jsonl of NUM_SAMPLES records, each longer than SEQ_LEN tokens."""
    from pydoc_data.topics import topics

    path = folder / "zoo-corpus.jsonl"
    texts = [topics[key][:600] for key in sorted(topics)[:NUM_SAMPLES]]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def judge(model_type: str, folder: Path) -> ZooResult:
    """Calibrate a tiny `model_type` in `folder` and compare with transformers' cache (never raises)."""
    try:
        make_zoo_config(model_type, folder / "config-only")
        from fp8kv.geometry import AttentionGeometry

        AttentionGeometry.from_dir(folder / "config-only")
        return _calibrate_and_compare(model_type, folder)
    except Fp8kvError as exc:
        return ZooResult(model_type, REFUSED, _one_line(str(exc)))
    except Exception as exc:  # the matrix reports every other failure instead of stopping
        return ZooResult(model_type, FAILING, _one_line(f"{type(exc).__name__}: {exc}"))


def _calibrate_and_compare(model_type: str, folder: Path) -> ZooResult:
    from transformers import AutoTokenizer

    from fp8kv.data import DataRequest, load_calibration_data
    from fp8kv.calibrate.pipeline import CalibrationRequest, calibrate

    src = make_zoo_checkpoint(model_type, folder / "src")
    data = DataRequest(dataset=corpus(folder), num_samples=NUM_SAMPLES, seq_len=SEQ_LEN)
    request = CalibrationRequest(model=str(src), out=folder / "out", data=data, batch_size=1, device="cpu")
    result = calibrate(request)
    samples = load_calibration_data(data, AutoTokenizer.from_pretrained(src)).samples
    from fp8kv.geometry import AttentionGeometry

    latent = AttentionGeometry.from_dir(src).latent is not None
    reference = latent_cache_amax(src, samples) if latent else cache_amax(src, samples)
    got = {layer: result.table.amax[i].amax(-1) for i, layer in enumerate(result.table.layers)}
    if sorted(reference) != sorted(got):
        return ZooResult(model_type, FAILING, f"cached layers {sorted(reference)} but fp8kv scaled {sorted(got)}")
    load_error = loads_in_transformers(folder / "out")
    worst = max(float(((got[layer] - reference[layer]).abs() / reference[layer]).max()) for layer in got)
    skipped = list(result.provenance.skipped_layers or ())
    note = f"layers {sorted(got)}" + (f", skipped {skipped}" if skipped else "")
    if worst == 0.0:
        return ZooResult(model_type, EXACT, note, load_error)
    if worst <= BF16_STEP:
        return ZooResult(model_type, TOLERANCE, f"{note}; amax off by {worst:.2e} relative", load_error)
    return ZooResult(model_type, FAILING, f"{note}; amax off by {worst:.2e} relative", load_error)


def judge_layerwise(model_type: str, folder: Path) -> ZooResult:
    """Calibrate a tiny `model_type` whole and with `layerwise=True`: EXACT when the scales are bit-identical.

    REFUSED: one of the two paths refuses (layer by layer must then say to use --no-layerwise, unless
    the whole-model path refuses the same way); FAILING: different scales or a traceback. Never raises.
    """
    from fp8kv.calibrate.pipeline import CalibrationRequest, calibrate
    from fp8kv.data import DataRequest

    try:
        src = make_zoo_checkpoint(model_type, folder / "src")
        data = DataRequest(dataset=corpus(folder), num_samples=NUM_SAMPLES, seq_len=SEQ_LEN)
        runs = {}
        for by_layer in (False, True):
            request = CalibrationRequest(model=str(src), data=data, batch_size=2, device="cpu", layerwise=by_layer)
            runs[by_layer] = calibrate(request).table
    except Fp8kvError as exc:
        return ZooResult(model_type, REFUSED, _one_line(str(exc)))
    except Exception as exc:  # the matrix reports every other failure instead of stopping
        return ZooResult(model_type, FAILING, _one_line(f"{type(exc).__name__}: {exc}"))
    whole, by_layer = runs[False], runs[True]
    if whole.layers != by_layer.layers or not torch.equal(whole.scales, by_layer.scales):
        differ = [layer for i, layer in enumerate(whole.layers)
                  if i >= len(by_layer.layers) or not torch.equal(whole.scales[i], by_layer.scales[i])]
        return ZooResult(model_type, FAILING, f"--layerwise scales differ from the whole model's at layers {differ}")
    return ZooResult(model_type, EXACT, f"layers {list(whole.layers)}")


def loads_in_transformers(model_dir: Path) -> str | None:
    """None when transformers' auto class loads `model_dir`, else its error in one line."""
    from fp8kv.checkpoint.load import model_class
    from fp8kv.geometry import read_config

    try:
        model_class(read_config(model_dir)).from_pretrained(model_dir)
    except Exception as exc:  # any failure is the finding
        return _one_line(f"{type(exc).__name__}: {exc}")
    return None


def cache_amax(model_dir: Path, samples: list[list[int]]) -> dict[int, torch.Tensor]:
    """Independent reference: per layer that caches K/V, float32 [2] max |K|, |V| in the cache the model returns."""
    from transformers import DynamicCache

    from fp8kv.checkpoint.load import model_class
    from fp8kv.geometry import read_config
    from fp8kv.transformers_cache import cache_kwargs

    model = model_class(read_config(model_dir)).from_pretrained(model_dir).eval()
    running: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for sample in samples:
            out = model(input_ids=torch.tensor([sample]), use_cache=True)  # the model builds its own cache
            cache = getattr(out, "past_key_values", None)
            if cache is None:  # decoders of encoder families (BERT), models keeping their own state, cache only
                # into a cache they are given
                cache = DynamicCache(config=model.config)
                model(input_ids=torch.tensor([sample]), **cache_kwargs(model, cache))
            cache = getattr(cache, "self_attention_cache", cache)  # a decoder's cache beside its empty cross-attention one
            for index, layer in enumerate(cache.layers):
                if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                    continue
                # the cache may hold tokens the model adds in front (CPM-Ant's prompt), never fewer than the sample
                assert layer.keys.shape[2] >= len(sample), "the cache dropped tokens; the reference needs them all"
                amax = torch.stack([layer.keys.abs().amax(), layer.values.abs().amax()]).float()
                running[index] = amax if index not in running else torch.maximum(running[index], amax)
    return running


def latent_cache_amax(model_dir: Path, samples: list[list[int]]) -> dict[int, torch.Tensor]:
    """Independent reference for multi-head latent attention: per layer float32 [2], max |latent| twice.

    The latent vLLM caches is `concat(kv_c_normed, k_pe)`. Both parts are read from the model's own
    forward without a cache: the output of `kv_a_layernorm` (times the gain some models apply before
    caching it), and the rope slice of the key its attention function receives (k_pe after RoPE,
    repeated over the heads).
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from fp8kv.checkpoint.load import model_class
    from fp8kv.geometry import read_config
    from fp8kv.runtime.latent import latent_gain

    running: dict[int, torch.Tensor] = {}

    def fold(layer: int, part: torch.Tensor) -> None:
        amax = part.detach().abs().amax().float()
        running[layer] = amax if layer not in running else torch.maximum(running[layer], amax)

    def attention(module, query, key, value, attention_mask, **kwargs):
        fold(module.layer_idx, key[..., module.qk_nope_head_dim:])
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("fp8kv_latent_reference", attention)
    AttentionMaskInterface.register("fp8kv_latent_reference", sdpa_mask)
    model = model_class(read_config(model_dir)).from_pretrained(model_dir, attn_implementation="fp8kv_latent_reference")
    for module in model.modules():
        if hasattr(module, "kv_a_layernorm") and hasattr(module, "layer_idx"):
            module.kv_a_layernorm.register_forward_hook(
                lambda _, __, out, layer=module.layer_idx, gain=latent_gain(module): fold(layer, out * gain))
    with torch.no_grad():
        for sample in samples:
            model.eval()(input_ids=torch.tensor([sample]), use_cache=False)
    return {layer: torch.stack([amax, amax]) for layer, amax in running.items()}


# verify on the calibrated output: a few held-out samples and tokens, the clamping engine only, on records
# of Python's documentation the calibration corpus does not read (it takes the first topics, this the last).
VERIFY_SAMPLES, VERIFY_LEN = 2, 32
PASS, WARN, FAIL, CRASH = "PASS", "WARN", "FAIL", "crash"


@dataclass(frozen=True)
class VerifyOutcome:
    """verify's outcome on one architecture: its verdict (PASS, WARN, FAIL); REFUSED when its fidelity check
    finds the bf16 runtime is not the model, or it refuses the checkpoint in one line; CRASH on any other
    exception. `fidelity_kl` / `fidelity_bound`: its bf16 runtime against transformers (None if not measured)."""

    status: str
    detail: str
    fidelity_kl: float | None = None
    fidelity_bound: float | None = None

    def cell(self) -> str:
        """The table cell: status, fidelity KL / bound, and the first reason unless PASS."""
        kl = "" if self.fidelity_kl is None else f" (KL {self.fidelity_kl:.1e} / {self.fidelity_bound:.0e})"
        return f"{self.status}{kl}" + (f": {self.detail}" if self.detail else "")


def verify_outcome(out_dir: Path, folder: Path) -> VerifyOutcome:
    """`fp8kv verify` of `out_dir` on CPU, its report and held-out text in `folder` (never raises)."""
    from pydoc_data.topics import topics

    from fp8kv.data import DataRequest
    from fp8kv.verify.request import VerifyRequest
    from fp8kv.verify.run import verify

    heldout = folder / "zoo-heldout.jsonl"
    heldout.write_text("".join(json.dumps({"text": topics[key][:600]}) + "\n"
                               for key in sorted(topics)[-VERIFY_SAMPLES:]))
    request = VerifyRequest(out_dir, data=DataRequest(str(heldout), num_samples=VERIFY_SAMPLES, seq_len=VERIFY_LEN),
                            batch_size=VERIFY_SAMPLES, num_prompts=1, prompt_len=8, new_tokens=2, device="cpu",
                            report_dir=folder / "verify-report", engines=("vllm-tpu",))
    try:
        report = verify(request).report
    except Fp8kvError as exc:  # the folder is a temporary one: the reason is what follows it
        return VerifyOutcome(REFUSED, _one_line(str(exc).removeprefix(f"{out_dir}: ")))
    except Exception as exc:  # the matrix reports every other failure instead of stopping
        return VerifyOutcome(CRASH, _one_line(f"{type(exc).__name__}: {exc}"))
    fidelity = report.held_out.fidelity
    kl, bound = (fidelity.kl_mean, fidelity.bound) if fidelity else (None, None)
    refused = fidelity is not None and fidelity.refuses
    status = REFUSED if refused else report.verdict
    reasons = [r.message for r in report.reasons if r.level == (FAIL if refused else status)]
    return VerifyOutcome(status, _one_line(reasons[0]) if reasons and status != PASS else "", kl, bound)


def _one_line(text: str) -> str:
    return " ".join(text.split())[:240]


def judge_and_verify(model_type: str, folder: Path) -> ZooResult:
    """`judge`, then `verify_outcome` on the output of an architecture that calibrated (never raises)."""
    result = judge(model_type, folder)
    if result.status not in (EXACT, TOLERANCE):
        return result
    return replace(result, verify=verify_outcome(folder / "out", folder))


def run_matrix(model_types: list[str], how: Callable[[str, Path], ZooResult] = judge_and_verify) -> list[ZooResult]:
    """Judge every architecture in its own temporary folder (`how`: `judge_and_verify` or `judge_layerwise`)."""
    results = []
    for model_type in model_types:
        with tempfile.TemporaryDirectory(prefix=f"fp8kv-zoo-{model_type}-") as folder:
            results.append(how(model_type, Path(folder)))
        print(f"{results[-1].model_type}: {results[-1].status}", file=sys.stderr, flush=True)
    return results


def markdown_table(results: list[ZooResult]) -> str:
    """The docs/architectures.md table: a count line, then one row per architecture."""
    counts = {status: sum(r.status == status for r in results) for status in (EXACT, TOLERANCE, REFUSED, FAILING)}
    head = ", ".join(f"{n} {status}" for status, n in counts.items())
    unloadable = sum(r.load_error is not None for r in results)
    rows = [f"| `{r.model_type}` | {r.status} | {'no' if r.load_error else '-' if r.status in (REFUSED, FAILING) else 'yes'} "
            f"| {_cell(r.detail)} | {_cell(r.verify.cell()) if r.verify else '-'} |" for r in results]
    return "\n".join([f"{len(results)} causal-LM architectures: {head}; {unloadable} of the outputs do not load "
                      f"in transformers; {verify_counts(results)}.", "",
                      "| architecture | scales | output loads in transformers | detail | verify (fidelity KL / bound) |",
                      "|---|---|---|---|---|", *rows])


def verify_counts(results: list[ZooResult]) -> str:
    """One phrase: how many calibrated outputs verify passes, warns, fails, refuses or crashes on."""
    verified = [r.verify.status for r in results if r.verify is not None]
    counts = ", ".join(f"{verified.count(s)} {s}" for s in (PASS, WARN, FAIL, REFUSED, CRASH) if s in verified)
    return f"verify on the {len(verified)} calibrated: {counts or 'none run'}"


def _cell(text: str) -> str:
    """A table cell without the temporary folder and without pipes."""
    return re.sub(r"/\S*/config-only/", "", text).replace("|", "/")


if __name__ == "__main__":
    layer_by_layer = "--layerwise" in sys.argv[1:]
    chosen = [a for a in sys.argv[1:] if a != "--layerwise"] or causal_lm_types()
    results = run_matrix(chosen, judge_layerwise if layer_by_layer else judge_and_verify)
    print(markdown_table(results))
    for r in results:
        if r.load_error:
            print(f"{r.model_type}: {r.load_error}", file=sys.stderr)
