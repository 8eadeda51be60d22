"""``attnfuse list``: every registered combinator, the plugins skipped as broken, and the combinators skipped
because another plugin or attnfuse itself has their name."""

from __future__ import annotations

import argparse
from typing import TextIO

from .common import first_line


def _table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header) - 1)]
    lines = []
    for row in (header, *rows):
        cells = [c.ljust(w) for c, w in zip(row, widths)] + [row[-1]]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def cmd_list(args: argparse.Namespace, out: TextIO) -> int:
    import warnings

    from ..combinator import Role
    from ..plugin_manager import PluginWarning, broken_plugins, combinators

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginWarning)  # listed below instead
        combinators()
    order = {role: i for i, role in enumerate(Role)}  # the kernel template's slot order
    entries = sorted(combinators().items(), key=lambda kv: (order[kv[1].combinator.role], kv[0]))
    rows = [(name, r.combinator.role.value, r.distribution, first_line(r.combinator.doc)) for name, r in entries]
    print(_table(rows, ("NAME", "ROLE", "DISTRIBUTION", "DESCRIPTION")), file=out)
    dists = sorted({r.distribution for _, r in entries})
    print(f"\n{len(rows)} combinators from {len(dists)} distribution(s): {', '.join(dists)}", file=out)
    broken = broken_plugins()
    plugins, clashes = [b for b in broken if b.combinator is None], [b for b in broken if b.combinator is not None]
    if plugins:
        print(f"\n{len(plugins)} broken plugin(s), skipped:", file=out)
        for b in plugins:
            print(f"  BROKEN  {b.describe()}", file=out)
    if clashes:
        print(f"\n{len(clashes)} combinator(s) skipped, their names taken:", file=out)
        for b in clashes:
            print(f"  SKIPPED {b.describe()}", file=out)
    return 1 if broken and args.strict else 0


def add_parser(sub) -> None:
    """Add ``list`` to the command's subparsers."""
    p = sub.add_parser("list", help="list every registered combinator, and plugins or combinators skipped")
    p.add_argument("--strict", action="store_true", help="exit 1 when a plugin or combinator was skipped")
    p.set_defaults(func=cmd_list)
