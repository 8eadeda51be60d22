"""docs/benchmarks.md is regenerated, not edited: ``attnfuse bench --markdown`` writes the page and keeps the
marked sections (``<!-- BEGIN name -->`` ... ``<!-- END name -->``) that other commands write with
``--markdown-section PATH``: benchmarks/hf_layer.py (Table 9), benchmarks/validation_cost.py,
benchmarks/hf_generate.py and benchmarks/template_launch.py. A section writer replaces its own section and
leaves every other byte of the page as it was."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attnfuse.bench import report, rows

ROOT = Path(__file__).resolve().parents[1]
PAGE = """# Benchmarks: a run

| a table of the run |

<!-- BEGIN first -->
## First
old body of first
<!-- END first -->

text between the sections

<!-- BEGIN second -->
## Second
<!-- END second -->
the end
"""


def meta(command: str) -> dict[str, str]:
    return {
        "date": "2026-12-03",
        "gpu": "NVIDIA H200",
        "torch": "2.11.0+cu130",
        "triton": "3.6.0",
        "python": "3.12.3",
        "transformers": "5.17.0",
        "command": command,
    }


def test_writing_a_section_replaces_it_and_nothing_else(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    report.write_section(str(page), "first", "## First\nnew body\n\n| x |")
    assert page.read_text() == PAGE.replace("old body of first\n", "new body\n\n| x |\n")
    report.write_section(str(page), "second", "## Second\nfilled")
    assert page.read_text().endswith("<!-- BEGIN second -->\n## Second\nfilled\n<!-- END second -->\nthe end\n")
    assert "new body" in page.read_text()  # the first section stays as written


def test_a_new_section_goes_at_the_end_and_a_missing_page_is_made(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    report.write_section(str(page), "third", "## Third")
    assert page.read_text() == PAGE + "\n<!-- BEGIN third -->\n## Third\n<!-- END third -->\n"
    fresh = tmp_path / "fresh.md"
    report.write_section(str(fresh), "third", "## Third")
    assert fresh.read_text() == "<!-- BEGIN third -->\n## Third\n<!-- END third -->\n"


@pytest.mark.parametrize(
    "broken",
    [PAGE.replace("<!-- END second -->\n", ""), PAGE + "<!-- BEGIN first -->\n## First again\n<!-- END first -->\n"],
    ids=["unclosed", "twice"],
)
def test_a_broken_marker_is_refused_and_the_page_left_alone(tmp_path, broken):
    page = tmp_path / "page.md"
    page.write_text(broken)
    with pytest.raises(
        ValueError,
        match=r"page.md: the line <!-- BEGIN (first|second) --> must open exactly one "
        r"section, closed by a line <!-- END \1 -->",
    ):
        report.write_section(str(page), "first", "## First")
    assert page.read_text() == broken


def test_the_bench_page_keeps_the_sections_in_order(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    kept = report.kept_sections(str(page))
    assert kept == (
        "<!-- BEGIN first -->\n## First\nold body of first\n<!-- END first -->\n\n"
        "<!-- BEGIN second -->\n## Second\n<!-- END second -->\n\n"
    )
    run = rows.Report(
        meta={**meta("attnfuse bench --suite memory"), "transformers": ""},
        lines={"memory": ["peak memory, attnfuse: 0.44 GiB"]},
    )
    page.write_text(report.markdown_page(run, page=str(page), kept=kept))
    text = page.read_text()
    assert text.startswith(
        "# Benchmarks: NVIDIA H200, 2026-12-03\n\n2026-12-03 · NVIDIA H200 · torch 2.11.0+cu130 · "
        "triton 3.6.0 · Python 3.12.3 · bf16, median ms of `triton.testing.do_bench`.\n"
    )
    assert "| a table of the run |" not in text and "- peak memory, attnfuse: 0.44 GiB" in text
    assert text.endswith(kept)
    assert report.kept_sections(str(page)) == kept  # rewriting again keeps them again


def test_the_docs_page_has_the_sections_of_the_scripts():
    names = [m["name"] for m in report.SECTION.finditer((ROOT / "docs" / "benchmarks.md").read_text())]
    assert names == [
        "hf_layer",
        "validation_cost",
        "hf_generate",
        "template_resources",
        "template_launch",
        "suite_packed",
        "suite_fp8",
        "suite_dropout",
    ]


def load(script: str):
    spec = importlib.util.spec_from_file_location(f"benchmarks_{script}", ROOT / "benchmarks" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_validation_cost_section(tmp_path):
    validation = load("validation_cost")
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    body = validation.section(
        {16: (0.2458, 0.1371), 64: (0.2451, 0.1369)},
        meta("python3 benchmarks/validation_cost.py --markdown-section docs/benchmarks.md"),
    )
    report.write_section(str(page), validation.SECTION, body)
    text = page.read_text()
    assert text.startswith(PAGE.rstrip("\n"))
    section = text[text.index("<!-- BEGIN validation_cost -->") :]
    assert "\n## Checking a KV cache's values\n\n2026-12-03 · NVIDIA H200 · torch 2.11.0+cu130" in section
    assert "```bash\npython3 benchmarks/validation_cost.py --markdown-section docs/benchmarks.md\n```" in section
    assert section.endswith(
        "| page size | validated ms | `validate=False` ms | ratio |\n|---|---|---|---|\n"
        "| 16 | 0.2458 | 0.1371 | 1.79 |\n| 64 | 0.2451 | 0.1369 | 1.79 |\n"
        "<!-- END validation_cost -->\n"
    )


def test_table_9_script_writes_its_section(tmp_path):
    """benchmarks/hf_layer.py --tiny (the CPU smoke run) with --markdown-section: its old section replaced by
    the run's tables, with the command that printed them; the rest of the page untouched."""
    page = tmp_path / "page.md"
    before = PAGE.replace("first", "hf_layer")
    page.write_text(before)
    env = {**os.environ, "ATTNFUSE_CACHE_DIR": str(tmp_path / "kernels")}
    argv = ["benchmarks/hf_layer.py", "--tiny", "--no-compile", "--rounds", "2", "--markdown-section", str(page)]
    run = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    text = page.read_text()
    start, end = text.index("<!-- BEGIN hf_layer -->\n"), text.index("<!-- END hf_layer -->\n")
    assert text[:start] + text[end:] == before.replace("<!-- BEGIN hf_layer -->\n## First\nold body of hf_layer\n", "")
    section = text[start:end].splitlines()
    assert section[1] == "## A Llama-3-8B decoder layer through HuggingFace (the paper's Table 9)"
    assert re.match(r"\d{4}-\d\d-\d\d · CPU · torch [^ ]+ · triton [^ ]+ · transformers [^ ]+ · Python ", section[3])
    assert section[3].endswith(" · float32, median ms of `triton.testing.do_bench`.")
    assert f"python3 {' '.join(argv)}" in section
    table = [line.split(" | ")[:2] for line in section if line.startswith("| ") and " | 32 | " in line]
    assert table == [["| sdpa", "32"], ["| attnfuse", "32"], ["| attnfuse+fuse_rope", "32"]]
    overhead = [line for line in section if line.startswith("- host time per call, ")]
    assert [line.split(":")[0] for line in overhead] == [
        "- host time per call, eager program call",
        "- host time per call, the custom op",
        "- host time per call, af.run_attention",
    ]
