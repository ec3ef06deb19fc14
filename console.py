"""Display: the one number format, the per-layer table, markdown and console tables for reports and cards."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
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


def layer_table(rows: Sequence[Any]) -> tuple[list[str], list[list[str]]]:
    """The per-layer table every report shows (calibrate, inspect, verify's report, the card): the headers of
    the `LAYER_COLUMNS` the rows have (mappings, or frozen row types read by attribute), and each row's cells
    through `fmt_number`."""
    keys = [key for key in LAYER_COLUMNS if any(_cell(row, key) is not None for row in rows)]
    cells = [[fmt_number(_cell(row, key), percent=key.endswith("saturation")) for key in keys] for row in rows]
    return [LAYER_COLUMNS[key] for key in keys], cells


def _cell(row: Any, key: str) -> Any:
    return row.get(key) if isinstance(row, Mapping) else getattr(row, key, None)


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured markdown table of already formatted cells."""
    def line(cells: list[str]) -> str:  # a | inside a cell (|x|/scale) would end it
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    return "\n".join([line(head), "|" + "---|" * len(head)] + [line(row) for row in rows])


def plain_table(head: list[str], rows: list[list[str]]) -> str:
    """Already formatted cells in columns padded to their widest cell, for a terminal or a log."""
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    lines = [head, ["-" * width for width in widths], *rows]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines)


def text_console(stderr: bool = False):
    """A rich console whose lines are never broken mid-sentence (piped to a file, rich would wrap them at 80
    columns); tables still fit the width."""
    from rich.console import Console

    return Console(stderr=stderr, soft_wrap=True)


def rich_table(head: list[str], rows: list[list[str]], title: str | None = None):
    """The console form of `markdown_table`: the same cells, right-aligned."""
    from rich.table import Table

    table = Table(title=title)
    for name in head:
        table.add_column(name, justify="right")
    for row in rows:
        table.add_row(*row)
    return table
