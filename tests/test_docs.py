"""Docs that agree with the code: README's figures are on the benchmark page, the tile table of
docs/plugins.md is the code's, and the ```python blocks of README.md and docs/*.md run.

docs/writing-a-combinator.md's blocks are tested with that tutorial. A block that cannot run on a CPU
(a fragment, a signature, pseudo-code) is marked by a line ``<!-- no-run: why -->`` just before it.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import attnfuse as af
from attnfuse.passes.tile import TABLE, TileConfig, TileRule, markdown_table
from attnfuse.plugin_manager import plugin_manager
from attnfuse.runtime.launch import clear_cache

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(?P<before>[^\n]*)\n```python\n(?P<code>.*?)```", re.S)
DOCS_WITH_CODE = ["README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md"))
                                 if p.name != "writing-a-combinator.md")]
# a figure: a number with a decimal point, or of three digits or more (N=8192, 3457 GB/s)
FIGURE = re.compile(r"(?<![\w.])\d+\.\d+(?![\d.])|(?<![\w.])\d{3,}(?![\d.])")


def python_blocks(path: str) -> tuple[list[str], list[str]]:
    """(the blocks to run, the no-run markers) of a markdown file, in order."""
    runnable, skipped = [], []
    for match in BLOCK.finditer((ROOT / path).read_text()):
        marker = re.fullmatch(r"<!-- no-run: (.+) -->", match["before"].strip())
        (skipped if marker else runnable).append(marker[1] if marker else match["code"])
    return runnable, skipped


def numbers(text: str) -> set[str]:
    """Every figure in ``text``, with thousands, decimals and N-prefixed sizes read as tokens."""
    return set(FIGURE.findall(text.replace("N=", "N ")))


def section(text: str, heading: str) -> str:
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def test_every_figure_of_readmes_status_is_on_the_benchmark_page():
    status = section((ROOT / "README.md").read_text(), "## Status")
    page = numbers((ROOT / "docs/benchmarks.md").read_text().replace("N", " "))
    quoted = numbers(status)
    assert {"1.127", "3511", "0.44", "16384"} <= quoted  # the figures are found at all
    assert sorted(quoted - page) == []


def test_figure_pattern():
    assert numbers("N=8192: 1.171 ms, 3457 GB/s, 15 of 16, 1.01–4.02×, Llama-3-8B, 2.11.0") == {
        "8192", "1.171", "3457", "1.01", "4.02"}


def test_plugins_page_shows_the_tile_table_of_the_code():
    text = (ROOT / "docs/plugins.md").read_text()
    start = text.index("| arch | kernel | variant | head dim |")
    shown = text[start:text.index("\n\n", start)]
    assert shown == markdown_table()
    assert len(shown.splitlines()) == len(TABLE) + 2


def test_tile_table_rendering():
    rules = (TileRule(arch="sm90", kernel="dq", variant="listed", head_dim=(65, 128),
                      config=TileConfig(block_m=64, block_n=32, num_warps=8, num_stages=3)),
             TileRule(head_dim=(1, 64), config=TileConfig(block_m=16, block_n=128)),
             TileRule(config=TileConfig(block_m=32, block_n=16, num_warps=1, num_stages=1)))
    assert markdown_table(rules).splitlines() == [
        "| arch | kernel | variant | head dim | BLOCK_M × BLOCK_N, warps, stages |", "|---|---|---|---|---|",
        "| `sm90` | `dq` | `listed` | 65–128 | 64 × 32, 8, 3 |", "| `*` | `*` | `*` | ≤ 64 | 16 × 128, 4, 2 |",
        "| `*` | `*` | `*` | any | 32 × 16, 1, 1 |"]


@pytest.fixture
def restored_plugins():
    """Plugins a docs block registers are unregistered afterwards, and kernels compiled with them dropped."""
    before = {name for name, _ in plugin_manager().list_name_plugin()}
    yield
    for name, _ in plugin_manager().list_name_plugin():
        if name not in before:
            af.unregister_plugin(name)
    clear_cache()


@pytest.mark.parametrize("path", DOCS_WITH_CODE)
def test_python_blocks_run(path, restored_plugins):
    """Each file's blocks run in order in one namespace that starts with torch, attnfuse and af."""
    runnable, skipped = python_blocks(path)
    namespace = {"torch": torch, "attnfuse": af, "af": af}
    for i, code in enumerate(runnable):
        exec(compile(code, f"{path} python block {i + 1}", "exec"), namespace)
    assert len(skipped) <= 3, f"{path}: {len(skipped)} blocks marked no-run; mark only what cannot run"
    if path == "README.md":  # its example's result against the float64 oracle
        q, k, v = (namespace[name].detach() for name in "qkv")
        err = (namespace["llama"](q, k, v).double() - namespace["llama"].reference(q, k, v)).abs().max().item()
        assert err < 1e-4
        assert all(torch.isfinite(namespace[name].grad).all() for name in "qkv")


def test_docs_have_python_blocks_to_run():
    """The runner is not vacuous: the pages that show code run it (prose-only pages have no blocks)."""
    counts = {path: len(python_blocks(path)[0]) for path in DOCS_WITH_CODE}
    assert {path: n for path, n in counts.items() if n} == {
        "README.md": 5, "docs/combinators.md": 4, "docs/plugins.md": 4}
