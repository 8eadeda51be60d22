"""Shared test settings: the kernel cache in a temporary directory, a seed per test, Hypothesis draws derived
from the test (derandomized) and failures that print their replay blob, the device tests run on, and how many
examples the fuzzers draw.

Under pytest-xdist (``-n 2``) every worker is its own process with its own session: its own kernel cache
directory, named after the worker, and the same seed for a test whichever worker runs it."""

import contextlib
import json
import os
import random
import shutil
import tempfile
import zlib

import pytest
import torch
from hypothesis import settings

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

settings.register_profile("attnfuse", print_blob=True, derandomize=True)  # draws follow the test, as its seed does
settings.load_profile("attnfuse")


def worker_id() -> str:
    """The pytest-xdist worker running this process ("gw0", "gw1", ...), or "main" without xdist."""
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


def pytest_configure(config):
    """Generated kernels go to a fresh temporary directory for the session (one per xdist worker), never the
    user's ~/.cache."""
    config._attnfuse_cache = tempfile.mkdtemp(prefix=f"attnfuse-test-kernels-{worker_id()}-")
    os.environ["ATTNFUSE_CACHE_DIR"] = config._attnfuse_cache
    _share_the_cores()


# Modules whose tests share costly module fixtures (processes spawned, packages installed, kernels compiled): under
# ``-n`` each runs whole on one worker, so its fixtures run once; every other test is spread on its own.
ONE_WORKER_MODULES = frozenset(
    f"tests/{name}.py"
    for name in (
        "test_context_parallel",
        "test_kit_output",
        "test_plugin_clash",
        "test_plugin_isolation",
        "test_show_resources",
        "test_source_checkout",
    )
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``-n``'s scheduler, unless a ``--dist`` is given: tests one by one, as ``load`` does, but
    ``ONE_WORKER_MODULES`` whole. (xdist's ``--dist loadgroup`` with ``xdist_group`` marks does this by suffixing
    test ids, which pytest 9.2's ids ignore: pytest-dev/pytest-xdist#1386.)"""
    if config.getvalue("dist") != "load" or any(a.startswith("--dist") for a in config.invocation_params.args):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModulesOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in ONE_WORKER_MODULES else nodeid

    return ModulesOnOneWorker(config, log)


def _share_the_cores() -> None:
    """Under ``-n N`` each worker's torch (and every process a test spawns, through OMP_NUM_THREADS) takes its
    share of the cores rather than all of them: N workers each running a thread per core would oversubscribe
    the machine (on two cores, tests/test_forward.py, test_decode.py and test_varlen.py under ``-n 2`` took 66 s so,
    55 s with a thread each). A thread count given is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def pytest_unconfigure(config):
    shutil.rmtree(getattr(config, "_attnfuse_cache", ""), ignore_errors=True)


def seed_of(nodeid: str) -> int:
    """The seed a test's random draws start from: a function of its id alone, so any order replays it."""
    return zlib.crc32(nodeid.encode())


@pytest.fixture(autouse=True)
def _seeded(request):
    """Seed torch and random from the test's id before each test; a failure report names the seed."""
    seed = seed_of(request.node.nodeid)
    torch.manual_seed(seed)
    random.seed(seed)
    request.node.user_properties.append(("seed", seed))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.failed:
        seed = dict(item.user_properties).get("seed")
        report.sections.append(
            (
                "replay",
                f"torch.manual_seed({seed}) and random.seed({seed}) were set from the "
                f"test id; rerun with: pytest '{item.nodeid}'",
            )
        )


def pytest_runtest_logreport(report):
    """With ATTNFUSE_TEST_LOG set (the GPU sessions' script sets it), each test's outcome is appended to that file
    as it happens, a failure with its report, so a run stopped by its time limit still says what passed, what
    failed and why (the pytest-xdist controller writes it, once)."""
    path = os.environ.get("ATTNFUSE_TEST_LOG")
    if not path or "PYTEST_XDIST_WORKER" in os.environ or not (report.when == "call" or report.outcome != "passed"):
        return
    with open(path, "a") as log:
        log.write(f"{report.outcome.upper()} {report.nodeid} ({report.when}, {report.duration:.1f} s)\n")
        if report.failed:
            log.write(f"{report.longreprtext[-4000:]}\n")


@pytest.fixture
def record(tmp_path, monkeypatch):
    """A temporary record of verified template instances: ``record(keys)`` writes it (None: no file at all)."""
    from attnfuse.kernels import verified, verify

    def write(keys: list[str] | None) -> None:
        path = tmp_path / ("verified.json" if keys is not None else "absent.json")
        if keys is not None:
            data = verify.record([{"key": k, "case": "c", "max_error": 0.01} for k in keys], set(), {})
            path.write_text(json.dumps(data))
        monkeypatch.setattr(verified, "RECORD", path)
        verified._verified.cache_clear()

    yield write
    verified._verified.cache_clear()


def stand_in(monkeypatch, module, name: str) -> type:
    """``module.name`` (a template instance's class) replaced, for the test, by a class that records each
    construction's arguments in its ``made`` instead of compiling; that class."""

    class StandIn:
        made: list[tuple] = []

        def __init__(self, *args):
            StandIn.made.append(args)

    monkeypatch.setattr(module, name, StandIn)
    return StandIn


def fuzz_examples(cpu_default: int, gpu_default: int) -> int:
    """ATTNFUSE_FUZZ_EXAMPLES overrides; otherwise a small count under the interpreter, more on a GPU."""
    return int(os.environ.get("ATTNFUSE_FUZZ_EXAMPLES", gpu_default if CUDA else cpu_default))


def last_call():
    """The ``Call`` (``attnfuse.runtime.call``) of the latest new call signature."""
    from attnfuse.runtime import launch

    return launch._calls[next(reversed(launch._calls))]


def hoisted_last_call() -> bool:
    """Whether the latest new call signature was planned with its qk transforms hoisted into passes."""
    from attnfuse.runtime import hoisted

    return isinstance(last_call().forward, hoisted.HoistedForward)


@pytest.fixture
def transform_passes(monkeypatch):
    """A list that receives one item per transform or gradient pass run (``runtime.hoisted.TransformPass``)."""
    from attnfuse.runtime import hoisted

    passes, run_pass = [], hoisted.TransformPass.__call__
    monkeypatch.setattr(hoisted.TransformPass, "__call__", lambda *a, **kw: passes.append(1) or run_pass(*a, **kw))
    return passes


def plan_setting(module, name: str, value):
    """``attnfuse.testing.plan_settings.plan_setting`` (imported when used, after this file set the caches)."""
    from attnfuse.testing.plan_settings import plan_setting as setting

    return setting(module, name, value)


@contextlib.contextmanager
def deterministic_algorithms():
    """``torch.use_deterministic_algorithms(True)`` inside the block (the setting before it restored after)."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)
