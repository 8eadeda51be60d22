"""Every cache is bounded: a program's traces and the call signatures in memory (least recently used dropped
first; a program's kernels live while a cached call uses them), the kernel files on disk (a size cap); a
program that keeps being traced again warns once; ``attnfuse cache --info`` and ``--clear``."""

import os
import time
import warnings
import weakref

import pytest
import torch

import attnfuse as af
from attnfuse import KernelCacheError, RecompileWarning, recompile
from attnfuse.cli import main
from attnfuse.lru import LRUCache
from attnfuse.program import MAX_TRACES
from attnfuse.runtime import compiled, launch, source_cache
from attnfuse.runtime.launch import clear_cache
from attnfuse.runtime.source_cache import CACHE_ENV, MAX_BYTES_ENV, write_source

CONFIGS = 300  # distinct static values: past every in-memory bound

SCALE = 0.5  # read as a global by `scaled` below


@af.attention
def windowed(q, k, v, left, right=0):
    return af.softmax(af.sliding_window(af.scaled_dot_product(q, k), left=left, right=right)) @ v


@af.attention
def scaled(q, k, v):
    return af.softmax(af.scaled_dot_product(q, k, scale=SCALE)) @ v


class _Kernel:
    """Stands for a compiled kernel (no source generated): the caches' bounds do not depend on what they hold."""

    def __init__(self, plan, *_):
        self.plan = plan


@pytest.fixture
def stub_kernels(monkeypatch):
    for name in ("ForwardKernel", "DecodeKernel", "BackwardKernels"):
        monkeypatch.setattr(compiled, name, _Kernel)
    clear_cache()
    yield
    clear_cache()


@pytest.fixture
def no_recompile_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecompileWarning)
        yield


def _planned(graph, q):
    return launch.planned(graph, q, q, q, {}, None, None, return_lse=False, grads=None, split_kv=False)


def test_memory_caches_stay_at_their_bounds_and_keep_what_is_used(stub_kernels, no_recompile_warning, monkeypatch):
    """Past their bounds a program's traces and the calls drop the least recently used; a program's kernels
    live exactly while a cached call uses them."""
    monkeypatch.setattr(launch, "_calls", LRUCache(16))
    program = af.attention(windowed.fn)  # its own traces
    q = torch.empty(1, 2, 16, 16)
    used = _planned(program.graph(0), q)
    first = weakref.ref(_planned(program.graph(1), q).compiled)
    for left in range(2, CONFIGS):
        built = _planned(program.graph(left), q)
        assert _planned(program.graph(0), q) is used  # used all along: kept
        assert len(program._traces) <= MAX_TRACES and len(launch._calls) <= 16
    assert (len(program._traces), len(launch._calls)) == (MAX_TRACES, 16)
    assert len(compiled._index) == 16  # the kernels of the cached calls, and no others
    assert _planned(program.graph(CONFIGS - 1), q) is built  # recent: kept
    assert first() is None  # the oldest: dropped, its kernels freed


def test_call_signatures_are_bounded_and_share_their_programs_kernels():
    clear_cache()
    graph = windowed.graph(3)
    for n in range(1, launch.MAX_CALLS + 20):  # a signature per sequence length
        _planned(graph, torch.empty(1, 2, n, 16))
    calls = launch._calls.values()
    assert len(calls) == launch.MAX_CALLS
    assert len({id(call.compiled) for call in calls}) == len({id(call.forward) for call in calls}) == 1
    kept = weakref.ref(calls[0].compiled)
    del calls
    clear_cache()
    assert kept() is None and len(compiled._index) == 0  # no call uses them: the kernels are freed


def test_recompile_warning_fires_once_naming_the_program_and_what_changed():
    program = af.attention(windowed.fn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for left in range(recompile.RECOMPILE_LIMIT):
            program.graph(left, right=0)
        assert not caught
        program.graph(0, right=0)  # traced already: no new configuration
        program.graph(recompile.RECOMPILE_LIMIT, right=0)
        assert len(caught) == 1
        for left in range(recompile.RECOMPILE_LIMIT, 3 * recompile.RECOMPILE_LIMIT):
            program.graph(left, right=0)
    (warning,) = caught
    assert warning.category is RecompileWarning and warning.filename == __file__  # the caller's line
    message = str(warning.message)
    assert message.startswith(
        f"program windowed has been traced for {recompile.RECOMPILE_LIMIT + 1} static "
        f"configurations (more than attnfuse.recompile.RECOMPILE_LIMIT = "
        f"{recompile.RECOMPILE_LIMIT}); changing: 'left'. "
    )
    assert "'left' can only be static (sliding_window: parameter 'left' is static" in message
    assert "as a tensor argument" not in message and "raise attnfuse.recompile.RECOMPILE_LIMIT" in message


def test_recompile_warning_names_values_read_from_outside(monkeypatch):
    program = af.attention(scaled.fn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(recompile.RECOMPILE_LIMIT + 1):
            monkeypatch.setitem(globals(), "SCALE", 0.5 + i / 16)
            program.graph()
    (warning,) = caught
    assert "changing: values it reads from closures or globals." in str(warning.message)


def test_recompile_limit_can_be_raised(monkeypatch):
    monkeypatch.setattr(recompile, "RECOMPILE_LIMIT", 100)
    program = af.attention(windowed.fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecompileWarning)
        for left in range(20):
            program.graph(left)


# ------------------------------------------------------------------------------------------- on disk


def _source(i: int, size: int = 1000) -> tuple[str, str]:
    """A kernel name and a source of ``size`` bytes."""
    head = f"def attnfuse_fwd_{i:012x}():\n    pass\n#"
    return f"attnfuse_fwd_{i:012x}", head + "x" * (size - len(head) - 1) + "\n"


@pytest.fixture
def disk_cache(tmp_path, monkeypatch):
    directory = tmp_path / "kernels"
    monkeypatch.setenv(CACHE_ENV, str(directory))
    return directory


def _written(directory):
    return sorted(int(p.name.split("_")[2], 16) for p in directory.glob("attnfuse_*.py"))


def test_disk_cache_stays_under_its_cap_oldest_evicted_first(disk_cache, monkeypatch):
    monkeypatch.setenv(MAX_BYTES_ENV, "10000")  # ten files of 1000 bytes
    scans = []
    kernel_files = source_cache.kernel_files
    monkeypatch.setattr(source_cache, "kernel_files", lambda d: scans.append(d) or kernel_files(d))
    start = time.time() - 1000
    paths = {}
    for i in range(30):
        paths[i] = write_source(*_source(i))
        os.utime(paths[i], (start + i, start + i))  # written a second after the previous one
        assert sum(p.stat().st_size for p in disk_cache.iterdir()) <= 10000
    # the directory is counted on the first write, then only when a write passes the cap; each time
    # the oldest files go until 90% of the cap is left: 11 files -> 9, then two writes later again
    assert len(scans) == 1 + 10 and _written(disk_cache) == list(range(20, 30))
    write_source(*_source(21))  # used again: now the most recent
    assert len(scans) == 11  # a file used again is not counted
    for i in range(30, 32):
        write_source(*_source(i))
    assert _written(disk_cache) == [21] + list(range(23, 32))  # 20 and 22 went


def test_disk_cache_cap_from_the_environment_is_checked(disk_cache, monkeypatch):
    monkeypatch.setenv(MAX_BYTES_ENV, "64M")
    with pytest.raises(
        KernelCacheError,
        match=r"ATTNFUSE_CACHE_MAX_BYTES must be a positive number of bytes, "
        r"got '64M'",
    ):
        write_source(*_source(0))


def test_cli_cache_info_and_clear(disk_cache, monkeypatch, capsys):
    monkeypatch.setenv(MAX_BYTES_ENV, str(5 * 2**20))
    for i in range(3):
        write_source(*_source(i, size=700 + i))
    (disk_cache / "notes.txt").write_text("not a kernel")
    (disk_cache / "__pycache__").mkdir()
    (disk_cache / "__pycache__" / "attnfuse_fwd_0_0.cpython-311.pyc").write_bytes(b"left by an older version")
    assert main(["cache", "--info"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"directory  {disk_cache}  ($ATTNFUSE_CACHE_DIR)",
        "trusted    yes",
        "files      3",
        "size       2.1 KiB (2103 bytes)",
        "cap        5.0 MiB (5242880 bytes; $ATTNFUSE_CACHE_MAX_BYTES)",
    ]
    assert main(["cache", "--clear"]) == 0
    assert capsys.readouterr().out == f"removed 3 kernel file(s), 2.1 KiB, from {disk_cache}\n"
    assert sorted(p.name for p in disk_cache.iterdir()) == ["notes.txt"]
    assert main(["cache", "--info"]) == 0
    assert "files      0\nsize       0 B (0 bytes)\n" in capsys.readouterr().out


def test_cli_cache_info_says_why_a_directory_is_refused(disk_cache, capsys):
    disk_cache.mkdir(mode=0o700)
    os.chmod(disk_cache, 0o775)
    assert main(["cache", "--info"]) == 0
    assert (
        f"trusted    no: kernel cache directory {disk_cache} is writable by group (mode 775)" in capsys.readouterr().out
    )
    assert main(["cache"]) == 2  # --info or --clear
