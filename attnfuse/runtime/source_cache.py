"""Generated Triton source on disk: written once, loaded as a module, readable by users and the CLI.

Files live in ``$ATTNFUSE_CACHE_DIR`` (default ``~/.cache/attnfuse/kernels``), one per kernel, named by the
kernel and a hash of its source.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Callable

CACHE_ENV = "ATTNFUSE_CACHE_DIR"


def cache_dir() -> Path:
    """Where generated kernels are written."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "attnfuse" / "kernels"


def write_source(name: str, source: str) -> Path:
    """The path of ``source`` in the cache, writing it (atomically) if it is not there yet."""
    digest = hashlib.sha1(source.encode()).hexdigest()[:16]
    path = cache_dir() / f"{name}_{digest}.py"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    return path


def load_function(path: Path, name: str) -> Callable:
    """Import the generated module at ``path`` and return its undecorated function ``name``."""
    spec = importlib.util.spec_from_file_location(f"attnfuse_kernels.{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)
