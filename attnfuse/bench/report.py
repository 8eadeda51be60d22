"""Tables of result rows, and the benchmark page (docs/benchmarks.md) of a whole run, in markdown.

A cell is a median ms with TFLOP/s (compute-bound suites) or GB/s (decoding) in brackets; the ratio
columns are a baseline's time over AttnFuse's (above 1: AttnFuse is faster).
"""
from __future__ import annotations

import os
import textwrap

from .cases import GEOMETRIES, WINDOW
from .rows import CONTENDERS, SUITE_TITLES, Report, Row

KEPT = "<!-- Sections below come from other commands; `attnfuse bench --markdown` keeps them. -->"
RATIOS = {"flex": "flex / AttnFuse", "cudnn": "cuDNN / AttnFuse"}
EXPLANATION = ("Each row runs every contender in one process on the same inputs. TFLOP/s count only the (query, "
               "key) pairs a variant keeps (4·B·Hq·pairs·D forward, 3.5× that for forward+backward); decoding "
               "rows give GB/s of K and V read once. Ratio columns: a baseline's time over AttnFuse's (above 1: "
               "AttnFuse is faster). \"max abs diff\": AttnFuse's output (forward) or dQ (forward+backward) "
               "against a baseline's on the same inputs. Geometries (B, Hq, Hkv, D): "
               + ", ".join(f"{name} {shape}" for name, shape in GEOMETRIES.items())
               + f"; sliding_window keeps {WINDOW} keys per query, its own included; RoPE baselines attend with "
               "q and k pre-rotated by a compiled function, timed with them. Earlier runs are in this file's git "
               "history.")


def cell(row: Row, contender: str) -> str:
    value = row.times.get(contender)
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    rate = row.rate(value)
    return f"{value:.3f} ({rate:.0f} GB/s)" if row.unit == "GB/s" else f"{value:.3f} ({rate:.0f})"


def ratio_cell(row: Row, contender: str) -> str:
    ratio = row.ratio(contender)
    return "—" if ratio is None else f"{ratio:.2f}×"


def columns(rows: list[Row] | None) -> tuple[list[str], list[str]]:
    """The contenders and the ratios that some row of ``rows`` has, in table order (None: all of them,
    for lines printed before the table is complete)."""
    present = [c for c in CONTENDERS if rows is None or any(c in r.times for r in rows)]
    return present, [c for c in RATIOS if c in present and "attnfuse" in present]


def header(rows: list[Row] | None, unit: str = "TFLOP/s") -> str:
    contenders, ratios = columns(rows)
    unit = rows[0].unit if rows else unit
    titles = [f"{CONTENDERS[c]} ms ({unit})" if c == "attnfuse" else CONTENDERS[c] for c in contenders]
    titles = ["case", *titles, *(RATIOS[c] for c in ratios), "max abs diff"]
    return f"| {' | '.join(titles)} |\n|{'---|' * len(titles)}"


def format_row(row: Row, rows: list[Row] | None = None) -> str:
    """One table line; ``rows``: the table the line belongs to (its columns), default every column."""
    contenders, ratios = columns(rows)
    err = "—" if row.err is None else f"{row.err:.1e}"
    cells = [row.case, *(cell(row, c) for c in contenders), *(ratio_cell(row, c) for c in ratios), err]
    return f"| {' | '.join(cells)} |"


def table(rows: list[Row]) -> str:
    return "\n".join([header(rows), *(format_row(r, rows) for r in rows)])


def title(meta: dict[str, str]) -> str:
    return (f"{meta['date']} · {meta['gpu']} · torch {meta['torch']} · triton {meta['triton']} · "
            f"Python {meta['python']} · bf16, median ms")


def markdown_page(report: Report, plot: str | None = None, page: str | None = None, kept: str = "") -> str:
    """The benchmark page: its title and run, one section per suite, and the plot (a path, linked
    relative to where the page is written, ``page``); then ``kept``, the sections of other commands (from the
    line ``KEPT`` of the page written before, see ``kept_sections``)."""
    meta = report.meta
    lines = [f"# Benchmarks: {meta['gpu']}, {meta['date']}", "",
             f"{meta['gpu']} · torch {meta['torch']} · triton {meta['triton']} · Python {meta['python']} · "
             f"bf16, median ms of `triton.testing.do_bench`.", "",
             "Printed by:", "", "```bash", meta["command"], "```", ""]
    lines += [*meta.get("notes", "").splitlines(), ""] if meta.get("notes") else []
    lines += [textwrap.fill(EXPLANATION, width=105), ""]
    if plot:
        link = os.path.relpath(plot, os.path.dirname(page)) if page else plot
        lines += [f"![AttnFuse and the baselines, TFLOP/s against N]({link})", ""]
    for suite in report.suites():
        rows = [r for r in report.rows if r.suite == suite]
        lines += [f"## {SUITE_TITLES[suite]}", ""]
        lines += [table(rows)] if rows else [f"- {line}" for line in report.lines[suite]]
        lines.append("")
    if report.failures:
        lines += ["## Failed cases", "", *(f"- {failure}" for failure in report.failures), ""]
    return "\n".join(lines) + (f"\n{kept}" if kept else "")


def kept_sections(page: str) -> str:
    """What the existing page at path ``page`` holds from its ``KEPT`` line on ("" if none)."""
    try:
        with open(page) as f:
            text = f.read()
    except FileNotFoundError:
        return ""
    start = text.find(KEPT)
    return text[start:] if start >= 0 else ""
