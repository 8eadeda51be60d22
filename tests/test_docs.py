"""Docs that agree with the code: README's figures are on the benchmark page, the tile table of
docs/plugins.md is the code's, the ```python blocks of README.md and docs/*.md run, and README.md and docs/
hold no commit hashes (the docs say what is true now; a commit belongs in CHANGELOG.md or git's history).

docs/writing-a-combinator.md's blocks are tested with that tutorial. A block that cannot run on a CPU
(a fragment, a signature, pseudo-code) is marked by a line ``<!-- no-run: why -->`` just before it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import attnfuse as af
from attnfuse.passes.tile import FLOAT32_FMA_TILES, FMA_TILED_KERNELS, TABLE, TileConfig, TileRule, markdown_table
from attnfuse.plugin_manager import plugin_manager
from attnfuse.runtime.launch import clear_cache

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(?P<before>[^\n]*)\n```python\n(?P<code>.*?)```", re.S)
DOCS_WITH_CODE = [
    "README.md",
    *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "writing-a-combinator.md"),
]
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
    return text[start : end if end != -1 else None]


HEX = re.compile(r"(?<![\w`])(`?)([0-9a-f]{7,40})\1(?![\w`])")
HASH_PAGES = ["README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")))]


def commits(tokens: set[str]) -> set[str]:
    """The tokens this clone's git resolves to a commit (abbreviated or whole); none without git or history."""
    git = shutil.which("git")
    if not tokens or git is None or not (ROOT / ".git").exists():
        return set()
    done = subprocess.run(
        [git, "-C", str(ROOT), "cat-file", "--batch-check"],
        input="".join(f"{t}^{{commit}}\n" for t in sorted(tokens)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    return {t for t, line in zip(sorted(tokens), done.stdout.splitlines()) if line.split()[1:2] == ["commit"]}


def hashes(text: str) -> set[str]:
    """Commit hashes in ``text``: a backticked run of 7 to 40 lowercase hex digits with a digit among them (what
    else would it be?), or any such run that is a commit of this repository (a clone without that history, or
    a commit of another clone, is caught by the first rule)."""
    found = HEX.findall(text)
    return {token for ticks, token in found if ticks and re.search(r"\d", token)} | commits(
        {token for _, token in found}
    )


@pytest.mark.parametrize("page", HASH_PAGES)
def test_no_commit_hashes_in_readme_or_docs(page):
    assert sorted(hashes((ROOT / page).read_text())) == []


ISSUE = re.compile(r"\b(?:issue|PR|pull request)s?\s+#?\d+\b|(?:^|[^\w/&])#\d+\b", re.I | re.M)
# this file names hashes and issue numbers to test the finders; CHANGELOG.md is history
NOT_SCANNED = {"CHANGELOG.md", "tests/test_docs.py"}


def tracked_text_files() -> list[str]:
    """Every text file of the clone that git tracks (code, docs, scripts, configuration); none without git."""
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        return []
    files = subprocess.run(
        [git, "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    return [f for f in files if f not in NOT_SCANNED and (ROOT / f).is_file() and b"\0" not in (ROOT / f).read_bytes()]


def test_no_commit_hashes_or_issue_numbers_anywhere_in_the_tree():
    """Code comments, docstrings, scripts and docs say why, not where in the history: no commit hash (that this
    clone resolves, or backticked) and no "issue 14" or "#14" (an upstream project's ``owner/repo#N`` is a
    citation and allowed)."""
    files = tracked_text_files()
    if not files:
        pytest.skip("not a git clone: the tracked files are unknown")
    found = {}
    for path in files:
        text = (ROOT / path).read_text(errors="replace")
        refs = sorted(hashes(text)) + [m.group(0).strip() for m in ISSUE.finditer(text)]
        if refs:
            found[path] = refs
    assert found == {}


RUN_LOG = re.compile(r"(?<![\w.])\d+ (?:passed|failed|skipped|errors?|pass(?:es)?|fail(?:s|ures)?|skips?)\b")


@pytest.mark.parametrize("page", ["README.md", "CONTRIBUTING.md", *HASH_PAGES[1:]])
def test_no_run_logs_in_the_docs(page):
    """The docs say how to run the tests and what they cover, not what one run printed."""
    assert RUN_LOG.findall((ROOT / page).read_text()) == []


def test_run_log_finder():
    text = (
        "printed `142 passed, 28 warnings`; 33 pass and 56 skip, 83 passes and no failure, 2 failed; "
        "12 passes over; transformers 5.24 pass it"
    )
    assert RUN_LOG.findall(text) == ["142 passed", "33 pass", "56 skip", "83 passes", "2 failed", "12 passes"]


def test_issue_finder():
    text = "see issue 14, Issues #3 and PR 7; (#12). Not triton-lang/triton#9171, not &#160; or # 1 or N=14."
    assert [m.group(0).strip() for m in ISSUE.finditer(text)] == ["issue 14", "Issues #3", "PR 7", "(#12"]


def test_hash_finder():
    assert hashes("at `6009329`, not `defaced`, `attnfuse_fwd_6009329abcd` or LOG2E 1.4426950408889634") == {"6009329"}
    git = shutil.which("git")
    head = (
        git
        and subprocess.run([git, "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    )
    if not head or not commits({head}):
        pytest.skip("not a git clone with history: only backticked hashes are found")
    assert hashes(f"a bare {head[:9]}, and {head}, but not `attnfuse_fwd_{head[:12]}`") == {head[:9], head}


def test_every_figure_of_readmes_status_is_on_the_benchmark_page():
    status = section((ROOT / "README.md").read_text(), "## Status")
    page = numbers((ROOT / "docs/benchmarks.md").read_text().replace("N", " "))
    quoted = numbers(status)
    assert {"1.84", "0.26", "0.983", "16384"} <= quoted  # the figures are found at all
    assert sorted(quoted - page) == []


def test_readmes_status_is_short():
    lines = [line for line in section((ROOT / "README.md").read_text(), "## Status").splitlines()[2:] if line]
    assert len(lines) <= 12, lines


def test_architecture_is_a_reference_of_at_most_350_lines():
    text = (ROOT / "docs/architecture.md").read_text()
    assert len(text.splitlines()) < 350
    assert "## Compiler and runtime boundary" in text  # the section the compiler's structure is described in
    assert re.search(r"\bsince `|\bthe second run\b", text) is None


def test_figure_pattern():
    assert numbers("N=8192: 1.171 ms, 3457 GB/s, 15 of 16, 1.01–4.02×, Llama-3-8B, 2.11.0") == {
        "8192",
        "1.171",
        "3457",
        "1.01",
        "4.02",
    }


def test_plugins_page_shows_the_tile_table_of_the_code():
    text = (ROOT / "docs/plugins.md").read_text()
    start = text.index("| arch | kernel | variant | head dim |")
    shown = text[start : text.index("\n\n", start)]
    assert shown == markdown_table()
    assert len(shown.splitlines()) == len(TABLE) + 2


def test_plugins_page_shows_the_float32_fma_tiles_of_the_code():
    text = (ROOT / "docs/plugins.md").read_text()
    start = text.index("| head dim | forward | dK/dV | dQ |")
    shown = text[start : text.index("\n\n", start)].splitlines()[2:]
    want, smallest = [], 1
    for largest, tiles in FLOAT32_FMA_TILES:
        cells = [f"{t.block_m} × {t.block_n}, {t.num_warps} warps" for t in map(tiles.get, FMA_TILED_KERNELS)]
        want.append(f"| {smallest}–{largest} | " + " | ".join(cells) + " |")
        assert {(t.num_stages, t.max_registers) for t in tiles.values()} == {(2, 255)}, "the page says so"
        smallest = largest + 1
    assert shown == want


def test_tile_table_rendering():
    rules = (
        TileRule(
            arch="sm90",
            kernel="dq",
            variant="listed",
            head_dim=(65, 128),
            config=TileConfig(block_m=64, block_n=32, num_warps=8, num_stages=3),
        ),
        TileRule(head_dim=(1, 64), dtype="float8", config=TileConfig(block_m=16, block_n=128)),
        TileRule(config=TileConfig(block_m=32, block_n=16, num_warps=1, num_stages=1)),
    )
    assert markdown_table(rules).splitlines() == [
        "| arch | kernel | variant | head dim | dtype | BLOCK_M × BLOCK_N, warps, stages |",
        "|---|---|---|---|---|---|",
        "| `sm90` | `dq` | `listed` | 65–128 | `*` | 64 × 32, 8, 3 |",
        "| `*` | `*` | `*` | ≤ 64 | `float8` | 16 × 128, 4, 2 |",
        "| `*` | `*` | `*` | any | `*` | 32 × 16, 1, 1 |",
    ]


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
        "README.md": 8,
        "docs/combinators.md": 10,
        "docs/plugins.md": 4,
    }
