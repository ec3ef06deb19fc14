"""Display: markdown tables for reports and cards, and the text `fp8kv inspect` prints."""

from __future__ import annotations

from typing import Any

_INSPECT_COLUMNS = ("k_scale", "v_scale", "q_scale", "k_amax", "v_amax", "k_saturation", "v_saturation")


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured markdown table of already formatted cells."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def text_console(stderr: bool = False):
    """A rich console whose lines are never broken mid-sentence (piped to a file, rich would wrap them at 80
    columns); tables still fit the width."""
    from rich.console import Console

    return Console(stderr=stderr, soft_wrap=True)


def print_inspect_report(report: dict[str, Any]) -> None:
    """Render an `inspect_checkpoint` report as text tables on stdout."""
    from rich.table import Table

    console = text_console()
    console.print(f"[bold]{report['path']}[/bold] ({report['model_type']})")
    console.print(f"convention: {', '.join(report['conventions']) or 'none'}   kv dtype: {report['kv_dtype']}   "
                  f"strategy: {report['strategy'] or '-'}   kv heads: {report['num_kv_heads']}")
    if report.get("latent"):
        latent = report["latent"]
        console.print(f"MLA latent cache: kv_lora_rank {latent['kv_lora_rank']} + rope key "
                      f"{latent['qk_rope_head_dim']} values per token, one scale per layer (k_scale; v_scale repeats it)")
    if report["layers"]:
        table = Table()
        keys = [k for k in _INSPECT_COLUMNS if any(k in row for row in report["layers"])]
        for key in ("layer", *keys):
            table.add_column(key, justify="right")
        for row in report["layers"]:
            table.add_row(str(row["layer"]), *(_cell(row.get(k)) for k in keys))
        console.print(table)
    for note in report["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {note}")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return "[" + ", ".join(f"{x:.6g}" for x in value) + "]"
    return f"{value:.6g}" if isinstance(value, float) else str(value)
