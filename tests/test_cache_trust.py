"""The on-disk kernel cache is a readable copy, never code: bytecode planted beside a kernel's file and a file
swapped after it was checked never run, no bytecode is written, and a directory others can write is refused."""

import importlib.util
import marshal
import os
import re
import stat
import sys

import pytest
import torch

import attnfuse as af
from attnfuse import KernelCacheError
from attnfuse.runtime import kernel as kernel_module
from attnfuse.runtime.launch import clear_cache
from attnfuse.runtime.source_cache import CACHE_ENV
from attnfuse.testing import assert_matches_reference


@af.attention
def causal_softmax(q, k, v):
    return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh kernel cache directory (not created yet), and no kernel in memory before or after."""
    directory = tmp_path / "kernels"
    monkeypatch.setenv(CACHE_ENV, str(directory))
    clear_cache()
    yield directory
    clear_cache()


def _qkv(dtype=torch.float32):
    return tuple(torch.randn(1, 2, 32, 16, dtype=dtype) for _ in range(3))


def _assert_correct(q, k, v):
    """The kernel's result equals the float64 reference."""
    out = causal_softmax(q, k, v)
    assert_matches_reference(out, causal_softmax.reference(q, k, v), causal_softmax.reference(q, k, v, dtype=q.dtype))


def _hostile(marker, name: str) -> str:
    """A module that writes ``marker`` when it is run, and a kernel ``name`` that writes it when launched."""
    return (
        f"import pathlib\n"
        f"pathlib.Path({str(marker)!r}).write_text('module ran')\n"
        f"def {name}(*args, **kwargs):\n"
        f"    pathlib.Path({str(marker)!r}).write_text('kernel ran')\n"
    )


def _kernel_file(directory):
    (path,) = directory.glob("attnfuse_fwd_*.py")
    return path, path.stem.rsplit("_", 1)[0]  # <kernel name>_<source digest>.py


def _unchecked_hash_pyc(code, path) -> bytes:
    """Bytecode Python's import system runs without looking at the source (PEP 552, check_source unset)."""
    return (
        importlib.util.MAGIC_NUMBER
        + (0b01).to_bytes(4, "little")
        + importlib.util.source_hash(b"")
        + marshal.dumps(code)
    )


def _timestamp_pyc(code, path) -> bytes:
    """Bytecode whose header copies the real file's mtime and size, as the import system checks them."""
    st = path.stat()
    header = [0, int(st.st_mtime) & 0xFFFFFFFF, st.st_size & 0xFFFFFFFF]  # flags 0: checked by timestamp
    return importlib.util.MAGIC_NUMBER + b"".join(n.to_bytes(4, "little") for n in header) + marshal.dumps(code)


@pytest.mark.parametrize("pyc", [_unchecked_hash_pyc, _timestamp_pyc], ids=["unchecked-hash", "timestamp"])
def test_planted_bytecode_never_runs(pyc, cache, tmp_path):
    q, k, v = _qkv()
    _assert_correct(q, k, v)
    path, name = _kernel_file(cache)
    marker = tmp_path / "marker"
    planted = importlib.util.cache_from_source(str(path))
    os.makedirs(os.path.dirname(planted), exist_ok=True)
    with open(planted, "wb") as f:
        f.write(pyc(compile(_hostile(marker, name), str(path), "exec"), path))
    clear_cache()
    _assert_correct(q, k, v)
    assert not marker.exists()


def test_no_bytecode_is_written(cache, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # as by default (PYTHONDONTWRITEBYTECODE unset)
    _assert_correct(*_qkv())
    assert _kernel_file(cache) and not list(cache.rglob("*.pyc")) and not (cache / "__pycache__").exists()


def test_a_file_swapped_after_its_check_never_runs(cache, tmp_path, monkeypatch):
    """A rival process replaces the kernel's file with hostile code right after it was written and checked."""
    marker = tmp_path / "marker"
    write_source = kernel_module.write_source

    def write_then_swap(name, source):
        path = write_source(name, source)
        path.write_text(_hostile(marker, name))
        return path

    monkeypatch.setattr(kernel_module, "write_source", write_then_swap)
    q, k, v = _qkv(torch.float16)
    _assert_correct(q, k, v)
    assert not marker.exists()
    path, name = _kernel_file(cache)
    assert f"def {name}(*args, **kwargs)" in path.read_text()  # the swap happened; its code did not run


def test_created_directories_are_private(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "a" / "b" / "kernels"))
    clear_cache()
    try:
        _assert_correct(*_qkv())
    finally:
        clear_cache()
    for directory in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "kernels"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory


@pytest.mark.parametrize(
    "mode, what",
    [(0o770, "group"), (0o707, "others"), (0o1777, "group and others")],
    ids=["group", "world", "world-sticky"],
)
def test_a_directory_others_can_write_is_refused(mode, what, cache):
    q, k, v = _qkv()
    _assert_correct(q, k, v)  # a directory made writable after first use is refused too
    os.chmod(cache, mode)
    clear_cache()
    with pytest.raises(
        KernelCacheError,
        match=rf"kernel cache directory {re.escape(str(cache))} is writable by "
        rf"{what}.*chmod go-w {re.escape(str(cache))}.*{CACHE_ENV}",
    ):
        causal_softmax(q, k, v)


def test_a_directory_owned_by_another_user_is_refused(cache, monkeypatch):
    cache.mkdir(mode=0o700)
    uid = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: uid + 1)
    with pytest.raises(
        KernelCacheError,
        match=rf"kernel cache directory {re.escape(str(cache))} is owned by uid "
        rf"{uid}, not by this user \(uid {uid + 1}\).*{CACHE_ENV}",
    ):
        causal_softmax(*_qkv())


def test_a_loaded_kernels_finalizer_run_under_the_cache_lock_does_not_deadlock(tmp_path):
    """The garbage collector may run a loaded function's finalizer (which forgets its source lines, under the
    cache's lock) in a thread that holds that lock already: eviction's directory scan allocates under it. A CI
    run once hung there for good. The lock must let its holder take it again (checked with a timeout, so a
    plain lock fails here rather than hanging), and a collection under it runs the finalizer."""
    import gc

    from attnfuse.runtime import source_cache

    with source_cache._lock:
        assert source_cache._lock.acquire(timeout=5), "the cache's lock is not reentrant: a finalizer would deadlock"
        source_cache._lock.release()
    source = "def attnfuse_probe():\n    return 1\n"
    path = tmp_path / "attnfuse_probe_0123456789abcdef.py"
    box = [source_cache.load_function(source, "attnfuse_probe", path)]
    filename = source_cache.code_filename(path)
    assert filename in source_cache._registered
    with source_cache._lock:
        box.clear()  # the last reference to the function: its finalizer runs now, under the lock
        gc.collect()
    assert filename not in source_cache._registered
