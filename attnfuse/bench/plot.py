"""Speed against N: one panel per (suite, geometry, variant), a line per contender (matplotlib, the
optional extra ``bench``)."""

from __future__ import annotations

from .rows import CONTENDERS, SUITE_TITLES, Row

PLOTTED_SUITES = ("forward", "backward", "sparse")  # suites whose cases step through N
MISSING = "--plot needs matplotlib: pip install matplotlib (from a clone of attnfuse: pip install -e '.[bench]')"


def require_matplotlib() -> None:
    """Raise ImportError with MISSING when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(MISSING) from exc


def panels(rows: list[Row]) -> dict[tuple[str, str, str], list[Row]]:
    """Rows of the plotted suites by (suite, geometry, variant), each panel's rows in order of N."""
    grouped: dict[tuple[str, str, str], list[Row]] = {}
    for row in rows:
        if row.suite in PLOTTED_SUITES and row.N is not None:
            grouped.setdefault((row.suite, row.geometry, row.variant), []).append(row)
    return {key: sorted(group, key=lambda r: r.N) for key, group in grouped.items()}


def plot(rows: list[Row], path: str, title: str, columns: int = 4) -> int:
    """Draw every panel into one PNG at ``path``; returns the number of panels (0: nothing drawn)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grouped = panels(rows)
    if not grouped:
        return 0
    n_rows = -(-len(grouped) // columns)
    fig, axes = plt.subplots(n_rows, columns, figsize=(4 * columns, 3.2 * n_rows), squeeze=False)
    for ax, ((suite, geometry, variant), group) in zip(axes.flat, grouped.items()):
        for color, (contender, label) in enumerate(CONTENDERS.items()):  # one colour per contender throughout
            points = [(r.N, r.rate(r.times[contender])) for r in group if isinstance(r.times.get(contender), float)]
            if points:
                ax.plot(
                    *zip(*points),
                    marker="o",
                    label=label,
                    color=f"C{color}",
                    linestyle="-" if contender == "attnfuse" else "--",
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks([r.N for r in group], [str(r.N) for r in group])
        ax.minorticks_off()
        ax.set_title(f"{SUITE_TITLES[suite]}: {geometry} {variant}", fontsize=9)
        ax.set_xlabel("N")
        ax.set_ylabel(group[0].unit)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(grouped) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=64)
    plt.close(fig)
    return len(grouped)
