"""Generated Triton source: compiled in memory from the text codegen gives, with a readable copy on disk.

The copy lives in ``$ATTNFUSE_CACHE_DIR`` (default ``~/.cache/attnfuse/kernels``), one file per kernel, named
by the kernel and a hash of its source; users, ``attnfuse show`` and error notes point at it. Nothing is ever
run from that directory: ``load_function`` compiles the source string itself (no import, so no bytecode is
read or written), and registers it in ``linecache`` under a name no file can answer for, so ``triton.jit``
and Triton's interpreter (which read a kernel's source with ``inspect.getsourcelines``) see those same bytes.

The directory must belong to the current user and be writable by no one else (a ``KernelCacheError``
otherwise); directories made here are private (0o700). Its kernel files are kept under
``$ATTNFUSE_CACHE_MAX_BYTES`` in all (``DEFAULT_MAX_BYTES`` by default): a write that takes them past it
removes the least recently written or used first.
"""

from __future__ import annotations

import hashlib
import linecache
import os
import re
import stat
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Callable, NamedTuple

from ..errors import KernelCacheError

CACHE_ENV = "ATTNFUSE_CACHE_DIR"
MAX_BYTES_ENV = "ATTNFUSE_CACHE_MAX_BYTES"
DEFAULT_MAX_BYTES = 64 * 2**20  # a generated kernel's file is 5-20 KB: thousands of them
KERNEL_FILE = re.compile(r"attnfuse_\w+_[0-9a-f]{16}\.py")  # "<kernel name>_<source digest>.py"

# Reentrant: a loaded function's finalizer (``_unregister``) takes it, and the garbage collector may run that
# finalizer in a thread that holds it already (any allocation under the lock, as eviction's directory scan): a
# plain lock deadlocked a CI run there
_lock = threading.RLock()
_totals: dict[Path, int] = {}  # directory -> bytes of its kernel files as this process last counted them
_registered: dict[str, int] = {}  # linecache name -> loaded functions using it


def cache_dir() -> Path:
    """Where generated kernels are written."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "attnfuse" / "kernels"


def max_bytes() -> int:
    """The cap on the total size of the kernel files (``$ATTNFUSE_CACHE_MAX_BYTES``)."""
    value = os.environ.get(MAX_BYTES_ENV, "").strip()
    if not value:
        return DEFAULT_MAX_BYTES
    try:
        cap = int(value)
    except ValueError:
        cap = 0
    if cap < 1:
        raise KernelCacheError(f"{MAX_BYTES_ENV} must be a positive number of bytes, got {value!r}")
    return cap


def check_directory(directory: Path) -> None:
    """Raise unless ``directory`` belongs to the current user and no one else can write it (POSIX)."""
    if os.name != "posix":
        return
    st = os.stat(directory)
    fix = f"or set {CACHE_ENV} to a directory of your own that only you can write"
    if st.st_uid != os.geteuid():
        raise KernelCacheError(
            f"kernel cache directory {directory} is owned by uid {st.st_uid}, not by this user "
            f"(uid {os.geteuid()}): another user could change what it holds; remove it, {fix}"
        )
    writers = [who for who, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if st.st_mode & bit]
    if writers:
        raise KernelCacheError(
            f"kernel cache directory {directory} is writable by {' and '.join(writers)} (mode "
            f"{stat.S_IMODE(st.st_mode):o}): run `chmod go-w {directory}`, {fix}"
        )


def _private_directory(directory: Path) -> None:
    """Make ``directory`` and its missing parents with mode 0o700, then check it."""
    missing, parent = [], directory
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    for path in reversed(missing):
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:  # made meanwhile by another thread or process: checked below like any other
            pass
    check_directory(directory)


def write_source(name: str, source: str) -> Path:
    """The path of ``source``'s readable copy in the cache. A file already there is kept only if its content is
    ``source`` exactly (it is then marked as used now); otherwise it is written again, atomically (a temporary
    file in the same directory, then ``os.replace``), and the oldest files go past the size cap."""
    digest = hashlib.sha1(source.encode()).hexdigest()[:16]
    directory = cache_dir()
    path = directory / f"{name}_{digest}.py"
    try:
        _private_directory(directory)
        if _content(path) == source:
            os.utime(path)
            return path
        data = source.encode("utf-8")
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".attnfuse-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        _count_written(directory, path, len(data))
    except OSError as exc:
        raise KernelCacheError(
            f"kernel cache file {path} could not be written ({exc}); set {CACHE_ENV} to a writable directory"
        ) from exc
    return path


def _content(path: Path) -> str | None:
    """The text of the file at ``path``, or None if there is none (or it is not UTF-8 text)."""
    try:
        return path.read_text(encoding="utf-8")
    except (FileNotFoundError, UnicodeDecodeError):
        return None


class KernelFile(NamedTuple):
    """A kernel file in the cache: its path, size in bytes and modification time in ns."""

    path: Path
    size: int
    mtime_ns: int


def kernel_files(directory: Path) -> list[KernelFile]:
    """The kernel files in ``directory``, least recently written or used first ([] if it does not exist)."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    files = []
    for entry in entries:
        try:
            if KERNEL_FILE.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                files.append(KernelFile(Path(entry.path), st.st_size, st.st_mtime_ns))
        except FileNotFoundError:  # removed meanwhile
            pass
    return sorted(files, key=lambda f: (f.mtime_ns, f.path.name))


def evict(directory: Path, cap: int, keep: Path | None = None) -> int:
    """If ``directory``'s kernel files hold more than ``cap`` bytes, remove the least recently used (never
    ``keep``) until they hold at most 90% of it, so that the next writes need not evict again; the bytes
    left."""
    files = kernel_files(directory)
    total = sum(f.size for f in files)
    if total <= cap:
        return total
    for f in files:
        if total <= cap - cap // 10:
            break
        if f.path != keep:
            f.path.unlink(missing_ok=True)
            total -= f.size
    return total


def _count_written(directory: Path, path: Path, size: int) -> None:
    """Add a written file to this process's count of the directory's bytes; count the directory itself (with
    other processes' files), and evict, on the first write and on one that takes the count past the cap."""
    cap = max_bytes()
    with _lock:
        total = _totals.get(directory)
        fits = total is not None and total + size <= cap
        _totals[directory] = total + size if fits else evict(directory, cap, keep=path)


def clear(directory: Path) -> tuple[int, int]:
    """Remove every kernel file in ``directory`` (and bytecode earlier versions left in its ``__pycache__``);
    the number of kernel files and their bytes."""
    files = kernel_files(directory)
    for f in files:
        f.path.unlink(missing_ok=True)
    pycache = directory / "__pycache__"
    if pycache.is_dir() and not pycache.is_symlink():
        for pyc in pycache.glob("attnfuse_*.pyc"):
            pyc.unlink(missing_ok=True)
        if not any(pycache.iterdir()):
            pycache.rmdir()
    with _lock:
        _totals.pop(directory, None)
    return len(files), sum(f.size for f in files)


def code_filename(path: Path) -> str:
    """The file name of the code compiled from the source whose copy is at ``path``: in angle brackets, which
    ``linecache`` never looks up on disk."""
    return f"<attnfuse kernel {path}>"


def load_function(source: str, name: str, path: Path) -> Callable:
    """Compile ``source`` in memory and return its undecorated function ``name``; ``path`` is its copy's path
    (in the code's file name, ``code_filename(path)``, and error messages)."""
    filename = code_filename(path)
    namespace = {"__name__": f"attnfuse_kernels.{path.stem}"}
    with _lock:  # before running it: the decorators of a template's helpers read their source lines
        _registered[filename] = _registered.get(filename, 0) + 1
        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    try:
        exec(compile(source, filename, "exec", dont_inherit=True), namespace)
        fn = namespace.get(name)
        if not callable(fn):
            raise KernelCacheError(
                f"generated kernel {name} could not be loaded: its source defines no function "
                f"{name} (its source is in {path})"
            )
    except KernelCacheError:
        _unregister(filename)
        raise
    except Exception as exc:
        _unregister(filename)
        raise KernelCacheError(
            f"generated kernel {name} could not be loaded: {type(exc).__name__}: {exc} (its source is in {path})"
        ) from exc
    weakref.finalize(fn, _unregister, filename)
    return fn


def _unregister(filename: str) -> None:
    """Forget a loaded function's source lines once no loaded function uses them."""
    with _lock:
        _registered[filename] -= 1
        if not _registered[filename]:
            del _registered[filename]
            linecache.cache.pop(filename, None)
