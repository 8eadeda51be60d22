"""Tables of result rows, the benchmark page (docs/benchmarks.md) of a whole run, in markdown, and the
marked sections other commands write into that page.

A cell is a median ms with TFLOP/s (compute-bound suites) or GB/s (decoding) in brackets; the ratio
columns are a baseline's time over AttnFuse's (above 1: AttnFuse is faster).

A marked section runs from a line ``<!-- BEGIN name -->`` to a line ``<!-- END name -->``. Its command
(``benchmarks/hf_layer.py``, ``benchmarks/validation_cost.py``, ``benchmarks/hf_generate.py`` or ``attnfuse bench``
for its suites, ``suite_NAME``, each with ``--markdown-section PATH``) replaces it and nothing else
(``write_section``); ``attnfuse bench --markdown``
rewrites the page around the marked sections and keeps them.
"""

from __future__ import annotations

import os
import re
import textwrap

from .cases import GEOMETRIES, WINDOW
from .rows import CONTENDERS, SUITE_TITLES, Report, Row

SECTION = re.compile(r"^<!-- BEGIN (?P<name>[\w.-]+) -->\n(?P<body>.*?)^<!-- END (?P=name) -->\n?", re.M | re.S)
RATIOS = {"flex": "flex / AttnFuse", "cudnn": "cuDNN / AttnFuse"}
EXPLANATION = (
    "Each row runs every contender in one process on the same inputs. TFLOP/s count only the (query, "
    "key) pairs a variant keeps (4·B·Hq·pairs·D forward, 3.5× that for forward+backward); decoding "
    "rows give GB/s of K and V read once. Ratio columns: a baseline's time over AttnFuse's (above 1: "
    'AttnFuse is faster). "max abs diff": AttnFuse\'s output (forward) or dQ (forward+backward) '
    "against a baseline's on the same inputs. Geometries (B, Hq, Hkv, D): "
    + ", ".join(f"{name} {shape}" for name, shape in GEOMETRIES.items())
    + f"; sliding_window keeps {WINDOW} keys per query, its own included; RoPE baselines attend with "
    "q and k pre-rotated by a compiled function, timed with them. Earlier runs are in this file's git "
    "history."
)


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


def versions(meta: dict[str, str]) -> str:
    """The run's date, GPU and software versions on one line (``meta``'s keys date, gpu, torch, triton,
    python, and transformers when given)."""
    hf = f" · transformers {meta['transformers']}" if meta.get("transformers") else ""
    return (
        f"{meta['date']} · {meta['gpu']} · torch {meta['torch']} · triton {meta['triton']}{hf} · "
        f"Python {meta['python']}"
    )


def title(meta: dict[str, str]) -> str:
    return f"{versions(meta)} · {meta.get('dtype', 'bf16')}, median ms"


def script_meta(argv: list[str], dtype: str = "bf16") -> dict[str, str]:
    """The ``meta`` of a run of a benchmarks/ script (its command line ``argv``, as ``sys.argv``): the date,
    the GPU (or "CPU"), the versions of torch, triton, transformers (when imported) and Python."""
    import datetime
    import platform
    import shlex
    import sys

    import torch
    import triton

    hf = sys.modules.get("transformers")
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "transformers": hf.__version__ if hf is not None else "",
        "dtype": dtype,
        "command": shlex.join(["python3", os.path.relpath(argv[0]), *argv[1:]]),
    }


def heading(level: str, name: str, meta: dict[str, str], explanation: str) -> list[str]:
    """The opening lines of a page (``level`` "#") or section ("##"): its heading, date and versions, the
    command that printed it (``meta['command']``), and what its tables measure."""
    return [
        f"{level} {name}",
        "",
        f"{title(meta)} of `triton.testing.do_bench`.",
        "",
        "Printed by:",
        "",
        "```bash",
        meta["command"],
        "```",
        "",
        textwrap.fill(explanation, width=105),
        "",
    ]


def markdown_page(report: Report, plot: str | None = None, page: str | None = None, kept: str = "") -> str:
    """The benchmark page: its title and run, one section per suite, and the plot (a path, linked
    relative to where the page is written, ``page``); then ``kept``, the marked sections of other commands
    (``kept_sections`` of the page written before)."""
    meta = report.meta
    lines = heading("#", f"Benchmarks: {meta['gpu']}, {meta['date']}", meta, EXPLANATION)
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


def suite_section(report: Report, suite: str) -> str:
    """One suite of a run as a marked section (``suite_NAME``, written by ``attnfuse bench --markdown-section``):
    its heading, the run, the table (or lines) and the suite's failed cases."""
    rows = [r for r in report.rows if r.suite == suite]
    lines = heading("##", SUITE_TITLES[suite], report.meta, EXPLANATION)
    lines += [table(rows)] if rows else [f"- {line}" for line in report.lines[suite]]
    failed = [f for f in report.failures if f.startswith(f"{suite} ")]
    lines += ["", "Failed cases:", "", *(f"- {failure}" for failure in failed)] if failed else []
    return "\n".join(lines)


def _read(page: str) -> str:
    try:
        with open(page) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _sections(text: str, page: str) -> list[re.Match]:
    """The marked sections of ``text`` (the page at ``page``); a ValueError naming the page and the marker
    for a BEGIN line without its END line, or a section marked twice."""
    found = list(SECTION.finditer(text))
    names = [m["name"] for m in found]
    begins = re.findall(r"^<!-- BEGIN ([\w.-]+) -->$", text, re.M)
    for name in begins:
        if begins.count(name) != 1 or name not in names:
            raise ValueError(
                f"{page}: the line <!-- BEGIN {name} --> must open exactly one section, closed by a "
                f"line <!-- END {name} -->; fix the page by hand"
            )
    return found


def kept_sections(page: str) -> str:
    """The marked sections of the page at path ``page``, in order, each followed by a blank line ("" if the
    page or its sections are missing)."""
    text = _read(page)
    return "".join(f"{m.group(0).rstrip()}\n\n" for m in _sections(text, page))


def write_section(page: str, name: str, body: str) -> None:
    """Replace the marked section ``name`` of the page at path ``page`` with ``body``, leaving every other
    line as it was; a page without that section gets it at its end (a missing page is created)."""
    text = _read(page)
    section = f"<!-- BEGIN {name} -->\n{body.strip()}\n<!-- END {name} -->\n"
    old = next((m for m in _sections(text, page) if m["name"] == name), None)
    if old is not None:
        text = text[: old.start()] + section + text[old.end() :]
    else:
        text = (text.rstrip("\n") + "\n\n" if text.strip() else "") + section
    with open(page, "w") as f:
        f.write(text)
