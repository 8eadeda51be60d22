"""Every ``pip install`` the docs show works from a clone, without an index holding attnfuse: in README.md,
CONTRIBUTING.md and docs/*.md, in fenced code blocks and inline code, each command names only local paths
that exist (with extras their pyproject.toml declares), pip itself, or torch, triton and numpy (from any
index). No network: the names are checked, not installed."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml needs Python 3.11's tomllib or tomli")

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "CONTRIBUTING.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")))]
FROM_AN_INDEX = {"torch", "triton", "numpy", "pip"}
FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
COMMAND = re.compile(r"\bpip install\b(?P<args>[^;&|#]*)")
FLAGS = {"-q", "--quiet", "-U", "--upgrade", "--no-deps", "--no-build-isolation", "-e", "--editable"}
INDEXES = {"https://download.pytorch.org/whl/cpu"}  # --index-url: PyTorch's CPU wheels, for torch alone


def commands(text: str) -> list[str]:
    """The argument strings of every ``pip install`` in the page's code: fenced blocks, then inline code."""
    code = [block for block in FENCED.findall(text)]
    code += INLINE.findall(FENCED.sub("", text))
    return [m["args"].strip() for piece in code for line in piece.splitlines() for m in COMMAND.finditer(line)]


def problems(args: str, root: Path = ROOT) -> list[str]:
    """What in one ``pip install`` argument string would not install from a clone at ``root``."""
    found, words = [], shlex.split(args)
    if "--index-url" in words:
        at = words.index("--index-url")
        url, words = words[at + 1 : at + 2], words[:at] + words[at + 2 :]
        others = [w for w in words if not w.startswith("-") and re.split(r"[<>=!~\[]", w)[0] != "torch"]
        if not url or url[0] not in INDEXES or others:
            found.append(f"--index-url {' '.join(url)}: only {', '.join(sorted(INDEXES))}, for torch alone")
    for word in words:
        if word in FLAGS:
            continue
        if word.startswith("-"):
            found.append(f"{word}: an option this check does not know")
            continue
        name, extras = re.fullmatch(r"([^\[]+)(?:\[([^\]]*)\])?", word).groups()
        if name.startswith((".", "/")) or "/" in name:
            path = (root / name).resolve()
            pyproject = path / "pyproject.toml"
            if not pyproject.is_file():
                found.append(f"{word}: no pyproject.toml at {name}")
                continue
            declared = tomllib.loads(pyproject.read_text())["project"].get("optional-dependencies", {})
            found += [
                f"{word}: {name} has no extra {extra!r} (it has {', '.join(sorted(declared)) or 'none'})"
                for extra in filter(None, (extras or "").split(","))
                if extra.strip() not in declared
            ]
        elif re.split(r"[<>=!~\[]", name)[0] not in FROM_AN_INDEX:
            found.append(
                f"{word}: not a path in the clone, and not one of {', '.join(sorted(FROM_AN_INDEX))} "
                f'(attnfuse is on no package index: pip install -e ".[extra]" from the clone)'
            )
    return found


@pytest.mark.parametrize("page", PAGES)
def test_every_pip_install_in_the_docs_works_from_a_clone(page):
    text = (ROOT / page).read_text()
    assert [f"{args!r}: {p}" for args in commands(text) for p in problems(args)] == []


def test_the_docs_show_install_commands_at_all():
    found = {page: commands((ROOT / page).read_text()) for page in PAGES}
    assert any('-e ".[hf]"' in args for args in found["README.md"])
    assert any('-e ".[hf]"' in args for args in found["docs/integrations.md"])
    assert any(args.startswith('-e ".[test,') for args in found["CONTRIBUTING.md"])


def test_commands_are_found_in_blocks_and_inline_code():
    text = (
        "Run `pip install -e .` first.\n\n```bash\npython -m pip install -q torch==2.13.0 && .venv/bin/pip "
        'install -e ".[hf]"  # a comment\n```\nand `python3 -m pip install "attnfuse[hf]"`.\n'
    )
    assert commands(text) == ["-q torch==2.13.0", '-e ".[hf]"', "-e .", '"attnfuse[hf]"']


@pytest.mark.parametrize(
    "args, says",
    [
        ('"attnfuse[hf]"', "attnfuse[hf]: not a path in the clone"),
        ("attnfuse-softcap", "attnfuse-softcap: not a path in the clone"),
        ('-e ".[hf,gpu]"', ".[hf,gpu]: . has no extra 'gpu' (it has bench, hf, test)"),
        ("-e contrib/attnfuse-softcap", "contrib/attnfuse-softcap: no pyproject.toml at contrib/attnfuse-softcap"),
        ("-r requirements.txt", "-r: an option this check does not know"),
        ("torch --index-url https://example.com/simple", "--index-url https://example.com/simple: only"),
        ("triton==3.6.0 --index-url https://download.pytorch.org/whl/cpu", "--index-url https://download.pytorch.org"),
    ],
)
def test_what_would_fail_is_named(args, says):
    assert any(p.startswith(says) for p in problems(args)), problems(args)


def test_what_works_passes():
    assert problems('--no-deps -e . -e contrib/attnfuse-sigmoid -e ".[test,bench,hf]"') == []
    assert problems('torch==2.13.0 triton==3.6.0 "numpy<2.3"') == []
    assert problems("torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu") == []
