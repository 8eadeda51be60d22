"""The built-ins without installed entry points: a source tree on PYTHONPATH, never ``pip install``-ed.

The subprocess tests run ``python -S`` (no site-packages, so no attnfuse distribution and no editable finder)
with PYTHONPATH = a copy of the source tree, then a folder linking every package of the site folders except
attnfuse's own and its plugins' (torch, triton, pluggy, attrs, ...).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import attnfuse as af
from attnfuse import builtin_plugins
from attnfuse.plugin_manager import BUILTIN_DISTRIBUTION, DISABLE_AUTOLOAD_ENV, plugin_manager

# Under -n one worker runs this module's fixtures once: conftest.ONE_WORKER_MODULES

ROOT = Path(__file__).resolve().parents[1]
BUILTIN_PLUGIN_NAMES = {f"{BUILTIN_DISTRIBUTION}:{m}" for m in builtin_plugins.MODULES}


def test_builtin_modules_are_the_entry_points():
    declared = {
        ep.name: ep.value
        for ep in importlib.metadata.entry_points(group="attnfuse")
        if ep.dist is not None and ep.dist.name == BUILTIN_DISTRIBUTION
    }
    assert declared == {m: f"attnfuse_plugins.{m}" for m in builtin_plugins.MODULES}


def test_installed_builtins_are_the_entry_points_registered_once():
    pm = plugin_manager()
    names = {name for name, _ in pm.list_name_plugin() if name.startswith(f"{BUILTIN_DISTRIBUTION}:")}
    assert names == BUILTIN_PLUGIN_NAMES
    for module in builtin_plugins.MODULES:
        assert pm.get_plugin(f"{BUILTIN_DISTRIBUTION}:{module}") is sys.modules[f"attnfuse_plugins.{module}"]
    builtins = [p for p in pm.get_plugins() if getattr(p, "__name__", "").startswith("attnfuse_plugins.")]
    assert len(builtins) == len(builtin_plugins.MODULES)


# --- a source tree on PYTHONPATH, in subprocesses ----------------------------------------------------------


@pytest.fixture(scope="module")
def site_without_attnfuse(tmp_path_factory) -> Path:
    """A folder linking every installed top-level package and distribution except attnfuse's and its plugins'."""
    site = tmp_path_factory.mktemp("site")
    folders = [Path(p) for p in sys.path if p and Path(p).name in ("site-packages", "dist-packages")]
    for folder in dict.fromkeys(f for f in folders if f.is_dir()):  # in sys.path order: the first one wins
        for entry in folder.iterdir():
            name = entry.name.lower()
            if not (name.startswith(("attnfuse", "__editable__")) or (site / entry.name).exists()):
                (site / entry.name).symlink_to(entry)
    return site


def source_tree(root: Path, *, plugins: bool = True) -> Path:
    """A copy of the clone's attnfuse/ (and plugins/) with its pyproject.toml, as a checkout has them."""
    root.mkdir()
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "attnfuse", root / "attnfuse", ignore=ignore)
    if plugins:
        shutil.copytree(ROOT / "plugins", root / "plugins", ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


def run_from(tree: Path, site: Path, *args: str, disable: str | None = None) -> subprocess.CompletedProcess:
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": os.environ.get("HOME", str(tree)),
        "PYTHONPATH": os.pathsep.join([str(tree), str(site)]),
        "ATTNFUSE_CACHE_DIR": str(tree / "kernels"),
    }
    if disable is not None:
        env[DISABLE_AUTOLOAD_ENV] = disable
    return subprocess.run([sys.executable, "-S", *args], env=env, cwd=tree, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("disable", [None, "1"], ids=["autoload", "autoload-disabled"])
def test_attnfuse_list_from_a_source_tree(tmp_path, site_without_attnfuse, disable):
    tree = source_tree(tmp_path / "clone")
    done = run_from(tree, site_without_attnfuse, "-m", "attnfuse.cli", "list", disable=disable)
    assert done.returncode == 0, done.stderr
    table, summary = done.stdout.split("\n\n")
    listed = {line.split()[0] for line in table.splitlines()[1:]}
    assert listed == {n for n, r in af.combinators().items() if r.distribution == BUILTIN_DISTRIBUTION}
    assert summary.strip() == f"{len(builtin_plugins.MODULES)} combinators from 1 distribution(s): attnfuse"
    assert "BROKEN" not in done.stdout


CHECK_PROGRAM = textwrap.dedent("""
    import json, sys
    import torch
    import attnfuse as af
    from attnfuse.plugin_manager import plugin_manager

    @af.attention
    def program(q, k, v):
        return af.softmax(af.causal(af.rope(q, k))) @ v

    gen = torch.Generator().manual_seed(14)
    q, k, v = (torch.randn(1, 2, 16, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    error = (program(q, k, v) - program.reference(q, k, v)).abs().max().item()
    print(json.dumps({"file": af.__file__, "plugins": sorted(n for n, _ in plugin_manager().list_name_plugin()),
                      "causal": af.causal.__name__, "error": error}))
""")


def test_a_program_runs_from_a_source_tree(tmp_path, site_without_attnfuse):
    tree = source_tree(tmp_path / "clone")
    done = run_from(tree, site_without_attnfuse, "-c", CHECK_PROGRAM)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(found["file"]) == tree / "attnfuse" / "__init__.py"
    assert set(found["plugins"]) == BUILTIN_PLUGIN_NAMES
    assert found["causal"] == "causal"
    assert found["error"] <= 1e-10


def test_a_tree_without_plugins_says_what_to_install(tmp_path, site_without_attnfuse):
    tree = source_tree(tmp_path / "clone", plugins=False)
    done = run_from(tree, site_without_attnfuse, "-m", "attnfuse.cli", "list")
    assert done.returncode == 2
    assert done.stdout == ""
    assert (
        f"attnfuse: error: the built-in combinators were not found: attnfuse, imported from {tree / 'attnfuse'}, "
        f"is not installed (no 'attnfuse' entry points) and there is no {tree / 'plugins'} folder beside it. "
        f"Install it: python -m pip install -e {tree}"
    ) in done.stderr
