"""Display: markdown tables for reports and cards, and the text `fp8kv inspect` prints."""

from __future__ import annotations

import math
from typing import Any

# The per-layer columns any table may show, in this order, with their headers; a table shows those its rows have.
LAYER_COLUMNS = {"layer": "layer", "k_amax": "K amax", "k_scale": "k_scale", "k_saturation": "K saturation",
                 "k_max_ratio": "K max |x|/scale", "v_amax": "V amax", "v_scale": "v_scale",
                 "v_saturation": "V saturation", "v_max_ratio": "V max |x|/scale", "q_amax": "Q amax",
                 "q_scale": "q_scale"}


def fmt_number(value: Any, percent: bool = False) -> str:
    """The one way numbers are shown: 4 significant digits, shares as percent with 2 decimals (3 significant
    below 1 %), NaN/inf spelled out, a list (per-head values) as its range; None as "-"."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return "NaN" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        if percent:
            return _percent(value)
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float)) for v in value):
        return f"{fmt_number(float(min(value)), percent)} – {fmt_number(float(max(value)), percent)} ({len(value)} heads)"
    return str(value)


def _percent(share: float) -> str:
    shown = share * 100
    return f"{shown:.2f} %" if shown == 0 or abs(shown) >= 1 else f"{shown:.3g} %"


def layer_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The per-layer table every report shows (calibrate, inspect, verify's report, the card): the headers of
    the `LAYER_COLUMNS` the rows have, and each row's cells through `fmt_number`."""
    keys = [key for key in LAYER_COLUMNS if any(row.get(key) is not None for row in rows)]
    cells = [[fmt_number(row.get(key), percent=key.endswith("saturation")) for key in keys] for row in rows]
    return [LAYER_COLUMNS[key] for key in keys], cells


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured markdown table of already formatted cells."""
    def line(cells: list[str]) -> str:  # a | inside a cell (|x|/scale) would end it
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    return "\n".join([line(head), "|" + "---|" * len(head)] + [line(row) for row in rows])


def text_console(stderr: bool = False):
    """A rich console whose lines are never broken mid-sentence (piped to a file, rich would wrap them at 80
    columns); tables still fit the width."""
    from rich.console import Console

    return Console(stderr=stderr, soft_wrap=True)


def print_inspect_report(report: dict[str, Any]) -> None:
    """Render an `inspect_checkpoint` report as text tables on stdout."""
    console = text_console()
    console.print(f"[bold]{report['path']}[/bold] ({report['model_type']})")
    console.print(f"convention: {', '.join(report['conventions']) or 'none'}   kv dtype: {report['kv_dtype']}   "
                  f"strategy: {report['strategy'] or '-'}   kv heads: {report['num_kv_heads']}")
    if report.get("latent"):
        latent = report["latent"]
        console.print(f"MLA latent cache: kv_lora_rank {latent['kv_lora_rank']} + rope key "
                      f"{latent['qk_rope_head_dim']} values per token, one scale per layer (k_scale; v_scale repeats it)")
    if report["layers"]:
        console.print(rich_table(*layer_table(report["layers"])))
    for note in report["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {note}")


def rich_table(head: list[str], rows: list[list[str]], title: str | None = None):
    """The console form of `markdown_table`: the same cells, right-aligned."""
    from rich.table import Table

    table = Table(title=title)
    for name in head:
        table.add_column(name, justify="right")
    for row in rows:
        table.add_row(*row)
    return table
