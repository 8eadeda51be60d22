"""No code for a torch or triton older than pyproject.toml requires: a comment or docstring naming such a version
("torch >= 2.7", "before torch 2.7") marks a branch that can no longer run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["attnfuse", "plugins", "benchmarks", "scripts", "contrib"]
VERSION = re.compile(r"\b(?P<package>torch|triton)\s*(?:[<>]=?|==)?\s*(?P<major>\d+)\.(?P<minor>\d+)(?![\d.]*\+)")


def minimums() -> dict[str, tuple[int, int]]:
    """{"torch": (2, 11), "triton": (3, 6)}: the lowest versions pyproject.toml's dependencies allow."""
    text = (ROOT / "pyproject.toml").read_text()
    return {
        package: tuple(int(x) for x in re.search(rf'"{package}>=(\d+)\.(\d+)[",]', text).groups())
        for package in ("torch", "triton")
    }


def older_than_required(text: str, lowest: dict[str, tuple[int, int]]) -> list[str]:
    return [m.group(0) for m in VERSION.finditer(text) if (int(m["major"]), int(m["minor"])) < lowest[m["package"]]]


def test_no_branch_for_an_unsupported_torch_or_triton():
    lowest = minimums()
    found = {
        str(path.relative_to(ROOT)): older
        for folder in SOURCES
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (older := older_than_required(path.read_text(), lowest))
    }
    assert found == {}


def test_old_versions_are_found():
    lowest = {"torch": (2, 11), "triton": (3, 6)}
    text = "# torch >= 2.7\nBefore torch 2.7, ...; triton<3.5; torch 2.11, triton 3.6, torch 2.13.0, torch.float32"
    assert older_than_required(text, lowest) == ["torch >= 2.7", "torch 2.7", "triton<3.5"]
    assert minimums() == {"torch": (2, 11), "triton": (3, 6)}
