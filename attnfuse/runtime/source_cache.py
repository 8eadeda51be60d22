"""Generated Triton source on disk: written once, loaded as a module, readable by users and the CLI.

Files live in ``$ATTNFUSE_CACHE_DIR`` (default ``~/.cache/attnfuse/kernels``), one per kernel, named by the
kernel and a hash of its source. A cached file is trusted only if its content is the source codegen gives
now (else it is written again); errors reading, writing or loading one are a ``KernelCacheError`` naming it.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Callable

from ..errors import KernelCacheError

CACHE_ENV = "ATTNFUSE_CACHE_DIR"


def cache_dir() -> Path:
    """Where generated kernels are written."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "attnfuse" / "kernels"


def write_source(name: str, source: str) -> Path:
    """The path of ``source`` in the cache. A file already there is used only if its content is ``source``
    exactly (a truncated, edited or half-written file is written again); every write is atomic (a temporary
    file in the same directory, then ``os.replace``)."""
    digest = hashlib.sha1(source.encode()).hexdigest()[:16]
    path = cache_dir() / f"{name}_{digest}.py"
    try:
        if _content(path) != source:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(source)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
    except OSError as exc:
        raise KernelCacheError(f"kernel cache file {path} could not be written ({exc}); set {CACHE_ENV} to a "
                               f"writable directory") from exc
    return path


def _content(path: Path) -> str | None:
    """The text of the file at ``path``, or None if there is none (or it is not UTF-8 text)."""
    try:
        return path.read_text(encoding="utf-8")
    except (FileNotFoundError, UnicodeDecodeError):
        return None


def load_function(path: Path, name: str) -> Callable:
    """Import the generated module at ``path`` and return its undecorated function ``name``."""
    try:
        spec = importlib.util.spec_from_file_location(f"attnfuse_kernels.{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return getattr(module, name)
    except Exception as exc:
        raise KernelCacheError(f"kernel cache file {path} could not be loaded: {type(exc).__name__}: {exc}; "
                               f"delete it (or the directory {path.parent}) to have it generated again") from exc
