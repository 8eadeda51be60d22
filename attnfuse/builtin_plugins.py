"""The built-in plugins where their entry points are missing: a source checkout used without ``pip install``
(``PYTHONPATH=/path/to/clone``), or an install whose metadata predates a built-in.

Installed, the built-ins are entry points of the ``attnfuse`` distribution, like any third party's plugins.
The plugin manager loads from here, as pytest loads its default plugins, only the built-ins that no entry
point named: under the same plugin names, so none is registered twice. Their package ``attnfuse_plugins``
is the clone's ``plugins/`` folder (pyproject's ``package-dir``); imported from a clone, it is loaded from
there.

The list of built-ins is kept once, in pyproject.toml's ``[project.entry-points.attnfuse]``: ``MODULES`` is
read from the pyproject.toml of the source tree this ``attnfuse`` was imported from, where there is one (a
clone, installed or not), else from the installed distribution's entry points.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

from .errors import PluginError

PACKAGE = "attnfuse_plugins"
DISTRIBUTION = "attnfuse"
SECTION = f"[project.entry-points.{DISTRIBUTION}]"
_ENTRY = re.compile(rf'(?P<name>[A-Za-z0-9_]+)\s*=\s*"{PACKAGE}\.(?P<module>[A-Za-z0-9_]+)"\s*(#.*)?')


def declared_modules(pyproject: str) -> tuple[str, ...] | None:
    """The built-in modules (``<name> = "attnfuse_plugins.<name>"`` lines) that the text of a pyproject.toml
    declares in ``[project.entry-points.attnfuse]``, in order; None where it has no such table."""
    lines = pyproject.splitlines()
    if SECTION not in (line.strip() for line in lines):
        return None
    table = lines[[line.strip() for line in lines].index(SECTION) + 1 :]
    table = table[: next((i for i, line in enumerate(table) if line.lstrip().startswith("[")), len(table))]
    found = [_ENTRY.fullmatch(line.strip()) for line in table if line.strip() and not line.lstrip().startswith("#")]
    if not all(found) or any(m["name"] != m["module"] for m in found):
        raise PluginError(f'{SECTION} of pyproject.toml: every line must read <name> = "{PACKAGE}.<name>"')
    return tuple(m["module"] for m in found)


def _modules() -> tuple[str, ...]:
    """The built-ins' modules, from the source tree's pyproject.toml, else the installed metadata, else none."""
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    declared = declared_modules(pyproject.read_text()) if pyproject.is_file() else None
    if declared is not None:
        return declared
    try:
        entry_points = importlib.metadata.distribution(DISTRIBUTION).entry_points
    except importlib.metadata.PackageNotFoundError:
        return ()
    return tuple(ep.name for ep in entry_points if ep.group == DISTRIBUTION)


MODULES = _modules()


def load(module: str) -> ModuleType:
    """The built-in plugin module ``attnfuse_plugins.<module>``, imported (call ``package()`` first)."""
    return importlib.import_module(f"{PACKAGE}.{module}")


def package() -> ModuleType:
    """``attnfuse_plugins``: importable when installed; otherwise the ``plugins/`` folder of the source tree
    this ``attnfuse`` was imported from. A ``PluginError`` saying what to install when there is neither."""
    try:
        return importlib.import_module(PACKAGE)
    except ModuleNotFoundError as exc:
        if exc.name != PACKAGE:
            raise
    tree = Path(__file__).resolve().parent.parent
    init = tree / "plugins" / "__init__.py"
    if not (init.is_file() and (tree / "pyproject.toml").is_file()):
        where = tree if (tree / "pyproject.toml").is_file() else "/path/to/your/attnfuse/clone"
        raise PluginError(
            f"the built-in combinators were not found: attnfuse, imported from {tree / 'attnfuse'}, "
            f"is not installed (no 'attnfuse' entry points) and there is no {tree / 'plugins'} "
            f"folder beside it. Install it: python -m pip install -e {where}"
        )
    spec = importlib.util.spec_from_file_location(PACKAGE, init, submodule_search_locations=[str(init.parent)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = package
    try:
        spec.loader.exec_module(package)
    except BaseException:
        del sys.modules[PACKAGE]
        raise
    return package
