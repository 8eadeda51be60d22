"""Every path, module, command and built-in that the docs name exists (README.md, CONTRIBUTING.md, docs/*.md;
CHANGELOG.md is history and not checked). A stale reference is a bug.

- relative links (``[text](path#anchor)``) resolve, anchors included (GitHub's heading ids);
- paths in code (inline or fenced, not python blocks, which tests/test_docs.py runs): a word with a ``/`` or
  ending in ``.py`` or ``.toml`` is a tracked file or folder, from the repository root, the page's folder, or,
  for the short names docs/architecture.md uses (``passes/fuse.py``, ``inputs.py``), the end of one;
- ``attnfuse.x.y`` (and ``af.x``, ``afd.x``) in code: the module imports and the attribute exists;
- ``python -m X``: X is an importable module;
- ``attnfuse CMD --option``: CMD is a subcommand of ``attnfuse`` and each option one of its options;
- the built-ins' tables (README.md's, docs/combinators.md's headings) list exactly pyproject.toml's entry points
  (``attnfuse.builtin_plugins.MODULES``), with the registered signature and role, and a count of the built-ins
  written as a word is their number.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import subprocess
from fnmatch import fnmatch
from pathlib import Path

import pytest

import attnfuse as af
from attnfuse.builtin_plugins import MODULES, declared_modules
from attnfuse.errors import PluginError
from attnfuse.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "CONTRIBUTING.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")))]
FENCED = re.compile(r"^```(?P<lang>[^\n]*)\n(?P<code>.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+)$", re.M)
# a word with a "/": a path where it ends in "/", its last part has an extension or its first part is a folder
# of the repository (so a ratio such as s/cap or 1/16 is none)
PATH = re.compile(r"(?<![\w/.-])[A-Za-z_.][\w.*-]*(?:/[\w.*-]*)+", re.A)
FILE = re.compile(r"[A-Za-z0-9_*-]+\.(?:py|toml)")  # an inline span that is one file name: `tile.py`
MADE_BY_THE_DOCS = (".venv", ".venv-ci", ".base")  # folders the documented commands create
OBJECT = re.compile(r"(?<![\w.])(?P<head>attnfuse|af|afd)(?P<tail>(?:\.[A-Za-z_]\w*)+)")
ALIASES = {"attnfuse": "attnfuse", "af": "attnfuse", "afd": "attnfuse.distributed"}
PYTHON_M = re.compile(r"\bpython3? -m (?P<module>[A-Za-z_][\w.]*)")
COMMAND = re.compile(r"(?<![\w./<-])(?<!import )attnfuse (?P<cmd>[a-z][\w-]*)(?P<rest>[^\n#|;&`]*)")
NUMBERS = dict(
    zip(
        "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
        "sixteen seventeen eighteen nineteen twenty".split(),
        range(1, 21),
    )
)


def tracked() -> list[str]:
    """The files git tracks, and every folder above them."""
    files = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    return sorted({*files, *(str(parent) for f in files for parent in Path(f).parents if str(parent) != ".")})


TRACKED = tracked() if (ROOT / ".git").exists() else []


def code_of(text: str, langs: tuple[str, ...] = ("bash", "toml", "mermaid")) -> list[str]:
    """The code of a page: its fenced blocks in ``langs`` (not python blocks, which tests/test_docs.py runs, nor
    unmarked ones: program output), then its inline code."""
    blocks = [m["code"] for m in FENCED.finditer(text) if m["lang"].strip() in langs]
    return blocks + INLINE.findall(FENCED.sub("", text))


def anchor(heading: str) -> str:
    """GitHub's id of a heading: lowercase, inline markup and punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text.replace("`", "")).replace(" ", "-")


def anchors(text: str) -> set[str]:
    found, seen = set(), {}
    for heading in HEADING.findall(FENCED.sub("", text)):
        base = anchor(heading)
        found.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return found


def stale_links(page: str, text: str) -> list[str]:
    stale = []
    for target in (m["target"] for m in LINK.finditer(text)):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, fragment = target.partition("#")
        where = (ROOT / page).parent / path if path else ROOT / page
        if not where.exists():
            stale.append(f"link {target}: no {path}")
        elif fragment and where.suffix == ".md" and fragment not in anchors(where.read_text()):
            stale.append(f"link {target}: no heading #{fragment} in {where.relative_to(ROOT)}")
    return stale


def path_exists(word: str, page: str) -> bool:
    word = word.split("#")[0].split(":")[0].rstrip(".,")
    if not word or word.startswith("/") or word.split("/")[0] in MADE_BY_THE_DOCS:
        return True  # an absolute example path, or a folder the documented commands make
    here = str(((ROOT / page).parent / word).resolve().relative_to(ROOT)) if not word.startswith("..") else word
    names = {word.rstrip("/"), here.rstrip("/"), str(Path(word))}
    return any(fnmatch(f, n) or fnmatch(f, f"*/{n}") for f in TRACKED for n in names)


def stale_paths(page: str, text: str) -> list[str]:
    top = {f for f in TRACKED if "/" not in f}
    words = {
        w
        for code in code_of(text)
        for piece in code.split()
        for w in PATH.findall(piece)
        if not re.search(r"[<${]|://", piece)
        and (w.endswith("/") or "." in w.rsplit("/", 1)[1] or w.split("/")[0] in top)
    }
    words |= {span for span in INLINE.findall(FENCED.sub("", text)) if FILE.fullmatch(span)}
    return [f"path {w}: not in the repository" for w in sorted(words) if not path_exists(w, page)]


def resolve(dotted: str) -> bool:
    """Whether ``a.b.c`` is a module, or an attribute of the longest importable prefix."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for name in parts[i:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def stale_objects(text: str) -> list[str]:
    """``attnfuse.x`` in code and prose, ``af.x`` and ``afd.x`` in code; not a combinator the page declares."""
    found = {(m["head"], m["tail"]) for code in code_of(text) for m in OBJECT.finditer(code)}
    found |= {(m["head"], m["tail"]) for m in OBJECT.finditer(text) if m["head"] == "attnfuse"}
    declared = {f".{name}" for name in re.findall(r'\bname="(\w+)"', text)}
    return [
        f"{head}{tail}: not found in {ALIASES[head]}"
        for head, tail in sorted(found)
        if tail not in declared and not resolve(ALIASES[head] + tail.rstrip("."))
    ]


def stale_modules(text: str) -> list[str]:
    modules = {m["module"].rstrip(".") for code in code_of(text) for m in PYTHON_M.finditer(code)}
    return [f"python -m {m}: no such module" for m in sorted(modules) if importlib.util.find_spec(m) is None]


def subcommands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def stale_commands(text: str) -> list[str]:
    commands, stale = subcommands(), []
    for code in code_of(text):
        for m in COMMAND.finditer(code):
            if m["cmd"] not in commands:
                stale.append(f"attnfuse {m['cmd']}: no such command (there are {', '.join(sorted(commands))})")
                continue
            known = commands[m["cmd"]]._option_string_actions
            stale += [
                f"attnfuse {m['cmd']} {option}: no such option"
                for option in re.findall(r"(?<![\w-])--?[A-Za-z][\w-]*", m["rest"])
                if option not in known
            ]
    return stale


@pytest.mark.parametrize("page", PAGES)
def test_every_reference_of_a_page_exists(page):
    if not TRACKED:
        pytest.skip("not a git clone: the tracked files are unknown")
    text = (ROOT / page).read_text()
    assert [
        *stale_links(page, text),
        *stale_paths(page, text),
        *stale_objects(text),
        *stale_modules(text),
        *stale_commands(text),
    ] == []


def test_the_checks_find_stale_references():
    """Each kind of reference, planted stale, is found; its live counterpart is not."""
    page = "docs/architecture.md"
    text = (
        "[ok](../README.md#quickstart) [gone](../docs/gone.md) [bad anchor](plugins.md#no-such-heading)\n"
        "`attnfuse/passes/tile.py`, `passes/lower.py`, `benchmarks/gone.py`, `runtime/nowhere.py`\n"
        "```bash\npython benchmarks/sweep_tiles.py && bash scripts/gone.sh\n"
        "python -m attnfuse.testing.planted_bugs; python -m attnfuse.gone\n"
        "attnfuse show llama --arch sm90 --kernel dq --nope\nattnfuse frobnicate\n```\n"
        "`attnfuse.hf.fuse_rope(model)`, `af.InputError`, `afd.shard`, `attnfuse.hf.gone`, `af.gone`\n"
    )
    assert stale_links(page, text) == [
        "link ../docs/gone.md: no ../docs/gone.md",
        "link plugins.md#no-such-heading: no heading #no-such-heading in docs/plugins.md",
    ]
    assert stale_paths(page, text) == [
        "path benchmarks/gone.py: not in the repository",
        "path runtime/nowhere.py: not in the repository",
        "path scripts/gone.sh: not in the repository",
    ]
    assert stale_modules(text) == ["python -m attnfuse.gone: no such module"]
    assert stale_commands(text) == [
        "attnfuse show --nope: no such option",
        f"attnfuse frobnicate: no such command (there are {', '.join(sorted(subcommands()))})",
    ]
    assert stale_objects(text) == [
        "af.gone: not found in attnfuse",
        "attnfuse.gone: not found in attnfuse",
        "attnfuse.hf.gone: not found in attnfuse",
    ]


def test_heading_anchors_are_githubs():
    assert anchors("# A\n## Forward + backward\n## Block-sparse (BigBird)\n## `rope(q, k)` and [x](y)\n## A\n") == {
        "a",
        "forward--backward",
        "block-sparse-bigbird",
        "ropeq-k-and-x",
        "a-1",
    }


# --- the built-ins: pyproject.toml's entry points, and the docs' tables of them ------------------------------

README_ROW = re.compile(r"^\| `(?P<name>\w+)(?P<signature>\([^`]*\))` \| (?P<role>[^|]+?) \|", re.M)
ROLE_SECTIONS = {
    "QK transforms": "qk transform",
    "Score sources": "score source",
    "Score modifications": "score modification",
    "Masks": "mask",
    "Normalisers": "normaliser",
}


def registered(name: str) -> tuple[str, str]:
    """(signature, role) of a registered combinator, as its ``af.<name>`` docstring's first line gives them."""
    first = getattr(af, name).__doc__.splitlines()[0]
    signature, role = re.fullmatch(r"(\w+\(.*\))  \[(.+)\]", first).groups()
    return signature, role


def test_readmes_table_lists_exactly_the_builtins():
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Built-in combinators") : text.index("\n## ", text.index("## Built-in combinators") + 1)]
    rows = {m["name"]: (m["name"] + m["signature"], m["role"]) for m in README_ROW.finditer(table)}
    assert sorted(rows) == sorted(MODULES)
    assert rows == {name: registered(name) for name in MODULES}


def test_combinators_page_has_a_section_per_builtin_under_its_role():
    text = (ROOT / "docs/combinators.md").read_text()
    found, role = {}, None
    for line in text.splitlines():
        if line.startswith("## "):
            role = ROLE_SECTIONS.get(line[3:])
        elif line.startswith("### `") and role:
            signature = line[5 : line.rindex("`")]
            found[signature.split("(")[0]] = (signature, role)
    assert found == {name: registered(name) for name in MODULES}


@pytest.mark.parametrize("page", PAGES)
def test_a_count_of_the_builtins_is_their_number(page):
    text = (ROOT / page).read_text()
    counts = re.findall(r"\b(\w+)\s+built-ins\b", text, flags=re.I)
    assert [c for c in counts if c.lower() in NUMBERS and NUMBERS[c.lower()] != len(MODULES)] == []


def test_builtins_are_read_from_the_entry_points_table():
    pyproject = (
        '[project]\nname = "x"\n\n[project.entry-points.attnfuse]\n# a comment\nb = "attnfuse_plugins.b"\n'
        'a = "attnfuse_plugins.a"  # why\n\n[tool.x]\nc = "attnfuse_plugins.c"\n'
    )
    assert declared_modules(pyproject) == ("b", "a")
    assert declared_modules('[project]\nname = "x"\n') is None
    with pytest.raises(PluginError, match=r"every line must read <name> = \"attnfuse_plugins.<name>\""):
        declared_modules('[project.entry-points.attnfuse]\nb = "attnfuse_plugins.c"\n')
    assert declared_modules((ROOT / "pyproject.toml").read_text()) == MODULES
