"""``attnfuse new NAME --role ROLE``: write a pip-installable plugin package for one combinator.

The package holds a pyproject (with the ``attnfuse`` entry point), one module declaring the combinator
with every field of its role filled in and commented, a test through the conformance kit's pytest
plugin, and a README. It installs and passes its test as generated; the author then edits the semantics.
"""

from __future__ import annotations

import importlib.util
import keyword
import re
from importlib import resources
from pathlib import Path

from ..errors import InputError

NAME = re.compile(r"[a-z](?:[a-z0-9_]*[a-z0-9])?")
"""A combinator name the package can carry: TOML bare keys and distribution names are ASCII, and a distribution
name ends with a letter or digit (attnfuse-NAME, with '-' for '_')."""
ROLES = ("mask", "normaliser", "score_mod", "score_source", "transform")


def _template(name: str) -> str:
    return resources.files(__name__).joinpath(f"{name}.txt").read_text()


def package_names(name: str) -> tuple[str, str]:
    """(distribution, module) for combinator ``name``: attnfuse-<name with dashes>, attnfuse_<name>."""
    return f"attnfuse-{name.replace('_', '-')}", f"attnfuse_{name}"


def _check_free(name: str, module: str) -> None:
    """Refuse a name the package could not provide once installed: attnfuse's own (its API, its submodules),
    a registered combinator's (installed beside it, the new one would be skipped), or one whose module is
    importable already (one would shadow the other)."""
    from ..plugin_manager import name_in_use

    taken = name_in_use(name)
    if taken is not None:
        raise InputError(
            f"NAME {name!r} is {taken}: installed, the new package could not provide af.{name}; choose another name"
        )
    if importlib.util.find_spec(module) is not None:
        raise InputError(
            f"NAME {name!r} would make a module {module!r}, but a module of that name is importable "
            f"already; choose another name"
        )


def scaffold(name: str, role: str, directory: Path | None = None) -> Path:
    """Write the package for combinator ``name`` of ``role`` into ``directory`` (default
    ./attnfuse-<name>); return the directory. Refuses to overwrite an existing one."""
    if not NAME.fullmatch(name) or keyword.iskeyword(name):
        raise InputError(
            f"NAME must be a lower-case Python identifier of ASCII letters a-z, digits and '_', "
            f"starting with a letter and not ending with '_', and no keyword: it names the module, the "
            f"distribution attnfuse-NAME and the entry point in pyproject.toml, which allow no more; "
            f"got {name!r}"
        )
    if role not in ROLES:
        raise InputError(f"--role must be one of {', '.join(ROLES)}, got {role!r}")
    dist, module = package_names(name)
    _check_free(name, module)
    root = Path(directory) if directory is not None else Path.cwd() / dist
    if root.exists() and any(root.iterdir()):
        raise InputError(f"directory {str(root)!r} exists and is not empty; choose another (--dir)")
    files = {
        "pyproject.toml": _template("pyproject"),
        f"{module}.py": _template(role),
        f"tests/test_{name}.py": _template("test"),
        "README.md": _template("readme"),
    }
    for path, text in files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(
            text.replace("__NAME__", name)
            .replace("__MODULE__", module)
            .replace("__DIST__", dist)
            .replace("__ROLE__", role)
        )
    return root
