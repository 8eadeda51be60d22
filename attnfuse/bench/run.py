"""One benchmark run: the chosen suites in order, a progress bar over their cases, each row printed as
it arrives, and the JSON, plot and markdown page rewritten after every suite (a run cut short keeps
what it measured)."""

from __future__ import annotations

import argparse
from typing import Callable, Iterable, TextIO

from . import measures, report, suites
from .rows import SUITE_TITLES, TABLE_SUITES, Report


def cases_of(suite: str, args: argparse.Namespace) -> tuple[int, Iterable]:
    """(number of cases, the (row function, arguments) pairs) of a table suite."""
    if suite == "forward":
        return (
            len(args.geometry) * len(args.N) * len(args.variants),
            suites.forward_cases(args.N, args.geometry, args.variants),
        )
    if suite == "backward":
        return (
            len(args.geometry) * len(args.backward_N) * len(args.backward_variants),
            suites.backward_cases(args.backward_N, args.geometry, args.backward_variants),
        )
    if suite == "decode":
        return 2 * len(suites.DECODE_MODELS) * 2, suites.decode_cases()
    if suite == "packed":
        return 2 * len(suites.PACKED_VARIANTS), suites.packed_cases()
    if suite == "fp8":
        return len(suites.FP8_CASES), suites.fp8_cases()
    if suite == "dropout":
        return len(suites.DROPOUT_NS), suites.dropout_cases()
    return 4, suites.sparse_cases()


def progress(total: int, description: str, out: TextIO) -> tuple[Callable[[], None], Callable[[str], None]]:
    """(advance, write) of a tqdm bar on stderr, or of plain printing where tqdm is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return (lambda: None), (lambda line: print(line, file=out, flush=True))
    bar = tqdm(total=total, desc=description, unit="case", leave=False)

    def advance() -> None:
        bar.update()
        if bar.n == total:
            bar.close()

    return advance, lambda line: bar.write(line, file=out)


def run_table(suite: str, args: argparse.Namespace, result: Report, out: TextIO) -> None:
    total, cases = cases_of(suite, args)
    print(
        f"## {SUITE_TITLES[suite]}\n\n{report.header(None, 'GB/s' if suite == 'decode' else 'TFLOP/s')}",
        file=out,
        flush=True,
    )
    advance, write = progress(total, suite, out)
    for make_row, case in cases:
        try:
            result.rows.append(make_row(*case))
            write(report.format_row(result.rows[-1]))
        except Exception as exc:
            failure = f"{suite} {' '.join(map(str, case[:3]))}: {type(exc).__name__}: {str(exc)[:300]}"
            result.failures.append(failure)
            write(f"| {failure} |")
        advance()


def save(args: argparse.Namespace, result: Report) -> None:
    if args.json:
        with open(args.json, "w") as f:
            f.write(result.to_json())
    plotted = False
    if args.plot:
        from .plot import plot

        plotted = plot(result.rows, args.plot, report.title(result.meta)) > 0
    if args.markdown:
        kept = report.kept_sections(args.markdown)
        with open(args.markdown, "w") as f:
            f.write(report.markdown_page(result, args.plot if plotted else None, args.markdown, kept))
    if args.markdown_section:
        for suite in result.suites():
            report.write_section(args.markdown_section, f"suite_{suite}", report.suite_section(result, suite))


def run(args: argparse.Namespace, meta: dict[str, str], out: TextIO) -> Report:
    from .timing import warm_up_gpu

    result = Report(meta=meta)
    print(report.title(meta), file=out, flush=True)
    warm_up_gpu()
    for suite in args.suite:
        if suite in TABLE_SUITES:
            run_table(suite, args, result, out)
        else:
            result.lines[suite] = measures.memory_lines() if suite == "memory" else measures.overhead_lines()
            print(f"## {SUITE_TITLES[suite]}\n", *result.lines[suite], sep="\n", file=out, flush=True)
        print(file=out)
        save(args, result)
    return result
