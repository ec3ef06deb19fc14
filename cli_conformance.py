"""`fp8kv conformance`: reference, simulate, check. Thin: the work is in `fp8kv.conformance.run`."""

from __future__ import annotations

from pathlib import Path

import typer

from fp8kv.cli_parse import Command, checked
from fp8kv.conformance.request import (
    BEHAVIOURS, CORRECT, SCALE_FACTORS, ReferenceRequest, SimulateRequest, behaviour_engine, check_scale_factor,
)
from fp8kv.errors import ExitCode
from fp8kv.options import RuntimeChoice, WriteMode

# Each command's defaults are its request's: one home for each.
_REFERENCE = ReferenceRequest(model_dir=Path(), out=Path())
_SIMULATE = SimulateRequest(pack_dir=Path(), behaviour=CORRECT, out=Path())

conformance_app = typer.Typer(
    no_args_is_help=True, rich_markup_mode=None,
    help="Does an engine write and read the fp8 KV cache correctly? fp8kv's log-probabilities per behaviour "
    "(the correct write and each known engine bug) against the engine's own.",
)


@conformance_app.command("reference", cls=Command)
def reference_command(
    model_dir: Path = typer.Argument(..., metavar="DIR", help="A checkpoint with KV scales (fp8kv calibrate's output)."),
    out: Path = typer.Option(..., "--out", help="The pack folder to write (replaced if it is a pack)."),
    scale_factor: float | None = typer.Option(
        _REFERENCE.scale_factor, "--scale-factor", callback=checked(check_scale_factor),
        help="Multiply the scales in PACK/model by this, in (0, 1] (below 1 exercises the clamp). "
        f"Default: of {', '.join(f'{f:g}' for f in SCALE_FACTORS)} and the factors that put some prompts past "
        "the fp8 limit and others below it, the one under which the behaviours lie furthest apart."),
    device: RuntimeChoice = typer.Option(
        _REFERENCE.device, "--device", help="Where fp8kv's runtime computes the references."),
    mode: WriteMode = typer.Option(
        _REFERENCE.mode, "--mode", help="PACK/model: overlay links the weights; copy copies them."),
) -> None:
    """Write PACK: fixed prompts, token ids, PACK/model (the engine loads it) and fp8kv's log-probabilities."""
    from fp8kv.conformance.run import reference
    from fp8kv.progress import StageProgress

    with StageProgress() as progress:
        pack = reference(ReferenceRequest(model_dir, out, scale_factor=scale_factor, device=device, mode=mode),
                         progress)
    typer.echo(f"Wrote {out}: {len(pack.prompts)} prompts, scales x{pack.scale_factor:g}, behaviours "
               f"{', '.join(pack.behaviours)} (at least {pack.separation:.3g} apart)")
    if pack.same_as_correct:
        typer.echo(f"note: on these prompts {', '.join(pack.same_as_correct)} give the correct log-probabilities; "
                   "this pack cannot tell them apart (lower --scale-factor)", err=True)
    typer.echo(f"Serve {out}/model, write its prompt log-probabilities as JSONL (probes/vllm_logprobs.py does it "
               f"for vLLM), then: fp8kv conformance check {out} ENGINE.jsonl; the same served with a bf16 cache, "
               "given as --bf16-answers, separates the engine's own arithmetic from its fp8 write")


@conformance_app.command("check", cls=Command)
def check_command(
    pack: Path = typer.Argument(..., metavar="PACK"),
    answers: Path = typer.Argument(..., metavar="ENGINE.jsonl", help='One line per prompt: {"id", "logprobs"}.'),
    bf16_answers: Path | None = typer.Option(
        None, "--bf16-answers", metavar="ENGINE-BF16.jsonl",
        help="The same engine's answers with a bf16 KV cache (vLLM: --kv-cache-dtype auto). Their distance from "
        "fp8kv's is the engine's own arithmetic; a match counts as close within that plus half the separation."),
    json_output: bool = typer.Option(False, "--json", help='Print {"match": NAME, "distances": {NAME: float}, '
                                     '"separation": float, "close": bool, "nonfinite": int, '
                                     '"arithmetic": float or null, "kept_distance": float, "lost": int, '
                                     '"lost_separation": int}.'),
) -> None:
    """Name the behaviour the engine's log-probabilities match. Exit 0 for correct (and no log-probability
    NaN/inf/null where the correct behaviour keeps every token), 3 otherwise."""
    from fp8kv.conformance.run import check

    result = check(pack, answers, bf16_answers)
    if json_output:
        typer.echo(result.to_json(), nl=False)
    else:
        typer.echo(f"matches: {result.match}")
        if result.nonfinite:
            typer.echo(f"note: {result.nonfinite} of the engine's log-probabilities are NaN/inf/null where the "
                       f"correct behaviour has finite ones: the engine loses tokens, so it is not correct", err=True)
        if not result.close:
            beyond = "" if result.arithmetic is None else " beyond its own arithmetic"
            typer.echo(f"note: the engine is further from {result.match}{beyond} than half the distance between two "
                       f"behaviours ({result.separation:.3g} on the tokens both keep; {result.lost_separation} tokens "
                       f"lost by one and not the other, against its {result.lost}): it matches none of them closely",
                       err=True)
        for name, value in sorted(result.distances.items(), key=lambda item: item[1]):
            typer.echo(f"  {name}: mean |delta logprob| {value:.4g}")
        if result.arithmetic is not None:
            typer.echo(f"  (the engine's own arithmetic, both with bf16 caches: {result.arithmetic:.4g})")
    raise typer.Exit(ExitCode.PASS if result.correct else ExitCode.FAIL)


@conformance_app.command("simulate", cls=Command)
def simulate_command(
    pack: Path = typer.Argument(..., metavar="PACK"),
    bug: str = typer.Option(..., "--bug", callback=checked(behaviour_engine),
                            help=f"{CORRECT}, or a bug: {', '.join(BEHAVIOURS[1:])}."),
    out: Path = typer.Option(..., "--out", help="The JSONL answer file to write."),
    device: RuntimeChoice = typer.Option(_SIMULATE.device, "--device", help="Where fp8kv's runtime runs."),
) -> None:
    """Answer the pack's prompts with fp8kv's runtime with BUG injected (what a buggy engine would write)."""
    from fp8kv.conformance.run import simulate
    from fp8kv.progress import StageProgress

    with StageProgress(quiet=True):  # one prefill: no stages to show, and no library bars either
        simulate(SimulateRequest(pack, bug, out, device=device))
    typer.echo(f"Wrote {out}")
