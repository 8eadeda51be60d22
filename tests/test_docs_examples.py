"""The ```python blocks of docs/writing-a-combinator.md run as written, in order, in one namespace
(```py blocks are excerpts). Section 10's blocks declare, register and check one combinator per role."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "writing-a-combinator.md"


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, code) of each ```python block."""
    return [
        (text[: m.start()].count("\n") + 2, m.group(1))
        for m in re.finditer(r"^```python\n(.*?)^```$", text, flags=re.M | re.S)
    ]


def test_page_has_a_complete_declaration_per_role():
    code = "\n".join(block for _, block in python_blocks(PAGE.read_text()))
    for role in ("MASK", "NORMALISER", "SCORE_MOD", "QK_TRANSFORM", "SCORE_SOURCE"):
        assert f"role=Role.{role}," in code
    for field in (
        "init=",
        "update=",
        "scaled_update=",
        "finalize=",
        "backward_rows=",
        "recompute=",
        "grad=",
        "combine=",
        "TensorArg(",
        "prepare=",
        "q_full_range=",
    ):
        assert field in code


def test_python_blocks_run():
    namespace: dict = {"__name__": "docs_writing_a_combinator"}
    for line, block in python_blocks(PAGE.read_text()):
        exec(compile(block, f"{PAGE.name}:{line}", "exec"), namespace)
