"""The model card (`README.md`) of a calibrated folder: Hub metadata, provenance, scales, results.

Everything shown comes from the folder itself: `fp8kv.json` (written by calibrate) and, when
present, `verify/report.json` and `verify/scales.png` (written by verify). A record without a
section (a folder converted from scales fp8kv did not calibrate) drops its rows.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from fp8kv.checkpoint.artifacts import CARD_FILE, CARD_MARKER, PROVENANCE_FILE, VERIFY_DIR, is_fp8kv_card, read_artifact
from fp8kv.checkpoint.conventions import COMPRESSION_CONFIG
from fp8kv.checkpoint.digest import check_unchanged
from fp8kv.checkpoint.provenance import Provenance, read_provenance as read_record
from fp8kv.console import markdown_table
from fp8kv.fp8 import FP8_MAX, VLLM_KV_CACHE_DTYPE
from fp8kv.options import DEFAULT_KV_DTYPE
from fp8kv.checkpoint.writer import write_file_atomic
from fp8kv.errors import Fp8kvError
from fp8kv.geometry import read_json
from fp8kv.checkpoint.hub_cache import is_repo_id, repo_id_from_cache_path
from fp8kv.verify.report import PLOT, REPORT_JSON, VerifyReport

REPORT_FILE = Path(VERIFY_DIR) / REPORT_JSON
PLOT_FILE = Path(VERIFY_DIR) / PLOT
TAGS = ["fp8", "kv-cache", "fp8kv", "vllm", "compressed-tensors"]
# Hub license ids are lowercase tokens ("apache-2.0", "llama3.1"); anything else goes in license_name.
_LICENSE_ID = re.compile(r"^[a-z0-9][a-z0-9.\-]*$")
_DATA_FILE = re.compile(r"\.(jsonl|json|txt|csv|parquet|arrow)$")
# (label, key, format) rows of the verify accuracy table.
_ACCURACY_ROWS = [
    ("Perplexity, bf16 KV cache", "ppl_bf16", "{:.4f}"),
    ("Perplexity, fp8 KV cache with these scales", "ppl_fp8", "{:.4f}"),
    ("Perplexity, fp8 KV cache with unit scales", "ppl_fp8_unit", "{:.4f}"),
    ("KL divergence to bf16, mean", "kl_mean", "{:.6g}"),
    ("KL divergence to bf16, max", "kl_max", "{:.6g}"),
    ("Top-1 agreement with bf16", "top1_agreement", "{:.4%}"),
]


def read_provenance(out_dir: Path) -> Provenance:
    """`DIR/fp8kv.json`; `Fp8kvError` when DIR is not an fp8kv calibrate output."""
    if Path(out_dir).is_file():
        raise Fp8kvError(f"{out_dir}: is a file, not a folder; pass the folder `fp8kv calibrate` wrote")
    record = read_record(out_dir)
    if record is None:
        raise Fp8kvError(f"{out_dir}: no {PROVENANCE_FILE}; pass a folder written by `fp8kv calibrate`")
    return record


def read_report(out_dir: Path) -> VerifyReport | None:
    """`DIR/verify/report.json`, or None when the folder was never verified.

    `Fp8kvError` when the report judged other scales, config or weight files than DIR holds now.
    """
    path = Path(out_dir) / REPORT_FILE
    text = read_artifact(path, "; rerun the fp8kv command that wrote it")
    if text is None:
        return None
    report = VerifyReport.from_json(text, path)
    check_unchanged(Path(out_dir), report.digest, path)
    return report


def write_card(out_dir: str | Path, *, repo_id: str | None = None, base_model: str | None = None) -> Path:
    """Write `DIR/README.md` atomically and return its path.

    A README copied from the source model (possibly a hard link to the source's file) is replaced
    by a new file; the source's copy is never written to. `repo_id` names the model in the serve
    commands (default: the folder path); `base_model` overrides the Hub id of the source model.
    """
    out = Path(out_dir)
    content = render_card(out, repo_id=repo_id, base_model=base_model)
    path = out / CARD_FILE
    write_file_atomic(path, content.encode("utf-8"))
    return path


def render_card(out_dir: str | Path, *, repo_id: str | None = None, base_model: str | None = None) -> str:
    """The card's full text (YAML metadata + markdown), checked by parsing it with huggingface_hub."""
    from huggingface_hub import ModelCard

    out = Path(out_dir)
    if base_model is not None and not is_repo_id(base_model):
        raise Fp8kvError(f"--base-model {base_model!r}: not a Hub model id org/name")
    prov = read_provenance(out)
    report = read_report(out)
    base_model, license_ = base_model or _base_model(out, prov), _license(out, prov)
    sections = [
        _intro(out, prov, base_model, repo_id),
        _what_was_done(prov, base_model),
        _scales(out, prov),
        _verify(out, report),
        _task_scores(out),
        _serve(str(repo_id or out), prov, COMPRESSION_CONFIG in (_quiet_json(out / "config.json") or {})),
        _limitations(prov),
    ]
    body = "\n\n".join(s for s in sections if s) + "\n"
    target = f"<!-- fp8kv card for: {repo_id or 'a local folder'} -->"
    text = f"---\n{_metadata(prov, base_model, license_).to_yaml()}\n---\n\n{CARD_MARKER}\n{target}\n\n{body}"
    ModelCard(text)  # raises if the metadata block does not parse
    return text


def _metadata(prov: Provenance, base_model: str | None, license_: str | None) -> Any:
    from huggingface_hub import ModelCardData

    extra: dict[str, Any] = {}
    if base_model:
        extra["base_model_relation"] = "quantized"
    if license_ and not _LICENSE_ID.match(license_):
        extra["license_name"], license_ = license_, "other"
    dataset = prov.dataset.name if prov.dataset else None
    # A local data file ("data/calib.jsonl") is not a Hub dataset id.
    is_hub_dataset = dataset is not None and is_repo_id(dataset) and not _DATA_FILE.search(dataset)
    datasets = [dataset] if is_hub_dataset else None
    return ModelCardData(
        base_model=base_model,
        license=license_,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=list(TAGS),
        datasets=datasets,
        **extra,
    )


def card_repo_id(path: Path) -> str | None:
    """The Hub id an fp8kv card at `path` was written for; None for a local card or another README."""
    if not is_fp8kv_card(path):
        return None
    match = re.search(r"^<!-- fp8kv card for: (\S+) -->$", Path(path).read_text(encoding="utf-8"), re.MULTILINE)
    return match[1] if match and is_repo_id(match[1]) else None


def _base_model(out: Path, prov: Provenance) -> str | None:
    """The source's Hub id: fp8kv.json, else the source config's `_name_or_path`, else its cache path."""
    if prov.source is None:
        return None
    config = _quiet_json(Path(prov.source.path) / "config.json") or {}
    candidates = [prov.source.base_model, config.get("_name_or_path"), repo_id_from_cache_path(prov.source.path)]
    return next((c for c in candidates if isinstance(c, str) and is_repo_id(c)), None)


def _license(out: Path, prov: Provenance) -> str | None:
    """The source's license, from its README metadata (or the copy of that README in DIR)."""
    readmes = [out / CARD_FILE]
    if prov.source is not None:
        readmes.insert(0, Path(prov.source.path) / CARD_FILE)
    for readme in readmes:
        if readme.is_file() and not is_fp8kv_card(readme):
            value = (_readme_metadata(readme) or {}).get("license")
            if isinstance(value, str) and value:
                return value
    return None


def _readme_metadata(readme: Path) -> dict[str, Any] | None:
    from huggingface_hub import metadata_load

    try:
        return metadata_load(readme)
    except Exception:  # noqa: BLE001 - a malformed source card only means "license unknown"
        return None


def _quiet_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`; None when it is absent or unreadable (it only adds a hint)."""
    try:
        return read_json(path) if path.is_file() else None
    except (Fp8kvError, OSError):
        return None


def _local_name(path: str | None) -> str | None:
    """A local source folder by its name only: a published card does not show the author's file system."""
    return Path(path).name if path is not None else None


def _fmt(value: Any, spec: str = "{:.6g}") -> str:
    """A number formatted for a table; lists (per-head scales) as their range; other values as text."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        return spec.format(value)
    if isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
        return f"{spec.format(min(value))} – {spec.format(max(value))} ({len(value)} heads)"
    return "" if value is None else str(value)


def _intro(out: Path, prov: Provenance, base_model: str | None, repo_id: str | None) -> str:
    title = repo_id or (f"{base_model} with FP8 KV-cache scales" if base_model else out.name)
    source = f"[{base_model}](https://huggingface.co/{base_model})" if base_model else "the source model"
    dtype = prov.kv_dtype or "fp8"
    return (
        f"# {title}\n\n"
        f"{source} with static {dtype} KV-cache scales (one `k_scale` and `v_scale` per attention layer), "
        "calibrated and written by fp8kv in the compressed-tensors "
        "convention that vLLM and SGLang load. The weights are the source's, unchanged; only the "
        "KV cache is stored in FP8."
    )


def _what_was_done(prov: Provenance, base_model: str | None) -> str:
    parts = ["## What was done"]
    if prov.command:
        parts.append(f"```bash\n{prov.command}\n```")
    source, data = prov.source, prov.dataset
    rows = [
        ("Tool", f"fp8kv {prov.version}"),
        ("Source", base_model or _local_name(source.path if source else None)),
        ("Source hash", source.content_hash if source else None),
        ("Strategy", prov.strategy),
        ("Headroom", prov.headroom),
        ("KV-cache dtype", prov.kv_dtype),
        ("Checkpoint convention", prov.format),
        ("Per-head scales", prov.per_head),
    ]
    if data is not None:
        rows += [("Calibration data", data.name), ("Split", data.split), ("Text column", data.text_column),
                 ("Samples", data.num_samples), ("Sequence length", data.seq_len),
                 ("Calibration tokens", data.num_tokens), ("Shuffle seed", data.seed)]
    shown = [[name, f"`{value}`" if isinstance(value, str) else _fmt(value)]
             for name, value in rows if value is not None]
    parts.append(markdown_table(["Setting", "Value"], shown))
    if data is not None and data.note:
        parts.append(f"Note: {data.note}.")
    return "\n\n".join(parts)


def _scales(out: Path, prov: Provenance) -> str:
    dtype_max = f"{FP8_MAX[_kv_dtype(prov)]:g}"
    parts = ["## KV-cache scales", (
        "Each scale is a dequantization multiplier: the engine stores "
        f"`fp8(clamp(x / scale, -{dtype_max}, {dtype_max}))` and reads back `fp8 × scale`. "
        f"With the `amax` strategy, `scale = amax / {dtype_max}`, amax being the largest "
        "|value| of that layer's cached K (or V, after RoPE and any k_norm) over all calibration tokens."
    )]
    if prov.layers:
        head = ["Layer", "K amax", "k_scale", "K saturation", "V amax", "v_scale", "V saturation"]
        rows = [[str(row.layer), *(_fmt(value) for cache in (row.k, row.v)
                                   for value in (cache.amax, cache.scale, cache.saturation))] for row in prov.layers]
        parts.append(markdown_table(head, rows))
    if prov.skipped_layers:
        skipped = ", ".join(str(i) for i in prov.skipped_layers)
        parts.append(f"Layers without their own KV cache (no scale): {skipped}.")
    if (out / PLOT_FILE).is_file():
        parts.append(f"![Per-layer KV-cache scales and verify results]({PLOT_FILE.as_posix()})")
    return "\n\n".join(parts)


def _verify(out: Path, report: VerifyReport | None) -> str:
    if report is None:
        return f"## Verify results\n\nNot verified. Run `fp8kv verify {out}` before publishing."
    parts = ["## Verify results", f"**Verdict: {report.verdict}**"]
    if report.reasons:
        parts.append("\n".join(f"- {r.level}: {r.message}" for r in report.reasons))
    setup = [("Device", report.device), ("Text", report.text_source), ("Samples", report.num_samples),
             ("Tokens", report.num_tokens), ("Convention", report.convention), ("KV-cache dtype", report.kv_dtype)]
    rows = [[name, _fmt(value)] for name, value in setup if value is not None]
    accuracy = report.accuracy or {}
    rows += [[name, _fmt(accuracy[key], spec)] for name, key, spec in _ACCURACY_ROWS if accuracy.get(key) is not None]
    # Shares of greedy tokens that match the bf16 cache.
    rows += [[f"Generation: {key.replace('_', ' ')}", _fmt(value, "{:.2%}")]
             for key, value in (report.generation or {}).items()]
    if rows:
        parts.append(markdown_table(["Check", "Result"], rows))
    layers = report.layers
    columns = [c for c in ("layer", "k_saturation", "v_saturation", "k_max_ratio", "v_max_ratio")
               if any(c in layer for layer in layers)]
    if columns:
        rows = [[_fmt(layer.get(c)) for c in columns] for layer in layers]
        parts.append(markdown_table([c.replace("_", " ") for c in columns], rows))
    return "\n\n".join(parts)


def _task_scores(out: Path) -> str:
    """The `fp8kv eval` table when DIR/eval/results.json exists, else nothing."""
    from fp8kv.evaluation.results import read_results

    results = read_results(out)
    return "" if results is None else "## Task scores\n\n" + results.markdown().rstrip()


def _kv_dtype(prov: Provenance) -> str:
    """The provenance's kv dtype; the default when it names none fp8kv knows."""
    return prov.kv_dtype if prov.kv_dtype in FP8_MAX else DEFAULT_KV_DTYPE


def _serve(model: str, prov: Provenance, kv_only_block: bool) -> str:
    sglang_dtype = _kv_dtype(prov)
    vllm_dtype = VLLM_KV_CACHE_DTYPE[sglang_dtype]
    transformers = (f"\n\ntransformers loads this model as its source, with an unquantized cache: it does not read "
                    f"`{COMPRESSION_CONFIG}`, where the scales are declared, and reports `k_scale`/`v_scale` as "
                    "unexpected keys.") if kv_only_block else ""
    return (
        "## How to serve\n\n"
        "The scales are only used when the KV cache is FP8, so pass the KV-cache dtype.\n\n"
        f"vLLM on GPU:\n\n```bash\nvllm serve {model} --kv-cache-dtype {vllm_dtype}\n```\n\n"
        f"vLLM on TPU (`pip install vllm-tpu`):\n\n```bash\nvllm serve {model} --kv-cache-dtype {vllm_dtype}\n```\n\n"
        f"SGLang:\n\n```bash\npython -m sglang.launch_server --model-path {model} --kv-cache-dtype {sglang_dtype}\n```"
        + transformers
    )


def _limitations(prov: Provenance) -> str:
    dataset = prov.dataset.name if prov.dataset else "the calibration data"
    items = [
        f"Scales are static and per tensor, measured on {dataset}. Values above the calibration amax are "
        "clamped to the fp8 range, so text far from that data can lose accuracy.",
        "An engine that casts to fp8 without clamping turns such values into NaN (torch ≤ 2.11 does not "
        "saturate); check the verify results above and your engine's version.",
        "Engines that find no scale use 1.0 silently: confirm in the engine's log that it loaded "
        "`k_scale`/`v_scale` for every attention layer.",
        "vLLM's TPU (Pallas) kernel needs an even number of KV heads for an fp8 cache.",
        "AMD GPUs (`e4m3fnuz`) double the scales at load time; the checkpoint stores the e4m3 scales.",
    ]
    strategy = prov.strategy or "amax"
    if strategy != "amax":
        items.append(f"The `{strategy}` strategy clips below the calibration amax on purpose: values above the clip "
                     "saturate (see the saturation columns).")
    if prov.per_head:
        items.append("Per-head scales are read by recent vLLM on the FlashAttention backend only.")
    if prov.skipped_layers:
        items.append("Layers listed as without their own KV cache reuse another layer's cache and have no scale.")
    if prov.defaulted_layers:
        defaulted = ", ".join(str(i) for i in prov.defaulted_layers)
        items.append(f"Calibration never reached layers {defaulted}; they carry the default scale 1.0.")
    return "## Limitations\n\n" + "\n".join(f"- {item}" for item in items)
