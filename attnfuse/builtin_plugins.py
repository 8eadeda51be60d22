"""The built-in plugins where their entry points are missing: a source checkout used without ``pip install``
(``PYTHONPATH=/path/to/clone``), or an install whose metadata predates a built-in.

Installed, the built-ins are entry points of the ``attnfuse`` distribution, like any third party's plugins.
The plugin manager loads from here, as pytest loads its default plugins, only the built-ins that no entry
point named: under the same plugin names, so none is registered twice. Their package ``attnfuse_plugins``
is the clone's ``plugins/`` folder (pyproject's ``package-dir``); imported from a clone, it is loaded from
there.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from .errors import PluginError

PACKAGE = "attnfuse_plugins"
# The modules of plugins/, as pyproject.toml's [project.entry-points.attnfuse] lists them (a test keeps the
# two equal), in that order.
MODULES = ("scaled_dot_product", "rope", "causal", "sliding_window", "full", "block_sparse", "alibi",
           "additive_bias", "softcap", "softmax", "relu_attention", "softmax_with_sinks")


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
        raise PluginError(f"the built-in combinators were not found: attnfuse, imported from {tree / 'attnfuse'}, "
                          f"is not installed (no 'attnfuse' entry points) and there is no {tree / 'plugins'} "
                          f"folder beside it. Install it: python -m pip install -e {where}")
    spec = importlib.util.spec_from_file_location(PACKAGE, init, submodule_search_locations=[str(init.parent)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = package
    try:
        spec.loader.exec_module(package)
    except BaseException:
        del sys.modules[PACKAGE]
        raise
    return package
