"""Programs called from many threads at once: first calls (tracing and compiling), decoding and training.
Every result equals the float64 reference, and each program is traced, and each (graph, config) planned
and each kernel loaded, exactly once (on a GPU, each binary compiled once); and the cache doing it, LRUCache."""

import threading
from collections import Counter

import pytest
import torch

import attnfuse as af
from attnfuse import program as program_module
from attnfuse.runtime import kernel as kernel_module
from attnfuse.passes import compiler
from attnfuse.runtime import launcher
from conftest import CUDA
from attnfuse.lru import LRUCache
from attnfuse.runtime.launch import clear_cache
from attnfuse.testing import assert_matches_reference

THREADS = 8
DTYPES = {"cpu": (torch.float32, torch.float16), "cuda": (torch.float32, torch.float16, torch.bfloat16)}


def _programs():
    """Fresh programs (traced in the test): rope (a device-cached table), ALiBi, a sliding window."""

    def rope(q, k, v):
        return af.softmax(af.causal(af.rope(q, k))) @ v

    def alibi(q, k, v):
        return af.softmax(af.alibi(af.causal(af.scaled_dot_product(q, k)))) @ v

    def window(q, k, v):
        return af.softmax(af.sliding_window(af.scaled_dot_product(q, k), left=8)) @ v

    return [af.attention(fn) for fn in (rope, alibi, window)]


@pytest.fixture
def builds(monkeypatch):
    """How many times each function was traced, each (graph, config) planned and each kernel loaded."""
    counts = {"traces": Counter(), "plans": Counter(), "kernels": Counter(), "binaries": Counter()}
    trace, compile_plan, load_function = program_module.trace, compiler.compile, kernel_module.load_function

    def counted(what, fn, key):
        def wrapper(*args):
            counts[what][key(*args)] += 1
            return fn(*args)

        return wrapper

    monkeypatch.setattr(program_module, "trace", counted("traces", trace, lambda fn, *_: fn))
    monkeypatch.setattr(compiler, "compile", counted("plans", compile_plan, lambda graph, config: (graph, config)))
    monkeypatch.setattr(
        kernel_module, "load_function", counted("kernels", load_function, lambda source, name, path: (name, source))
    )
    clear_cache()
    yield counts
    clear_cache()


def _together(jobs):
    """Run each job on its own thread, released at once by a barrier; their results (errors raised here)."""
    barrier = threading.Barrier(len(jobs))
    results = [None] * len(jobs)

    def run(i, job):
        barrier.wait()
        try:
            results[i] = job()
        except BaseException as exc:  # re-raised by the main thread
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def _assert_once(counts):
    for what, counter in counts.items():
        assert set(counter.values()) <= {1}, f"{what} built more than once: {counter}"
    assert counts["traces"] and counts["plans"] and counts["kernels"]


@pytest.mark.parametrize("device", ["cpu", "cuda"] if CUDA else ["cpu"])
def test_first_calls_from_many_threads_trace_and_compile_once(builds, device, monkeypatch):
    if device == "cuda":  # Triton compiles a binary for each specialisation at its first launch
        direct_launch = launcher._direct_launch
        monkeypatch.setattr(
            launcher, "_direct_launch", lambda kernel: builds["binaries"].update([kernel.hash]) or direct_launch(kernel)
        )
    programs = _programs()
    cases = [(p, dtype) for p in programs for dtype in DTYPES[device]]
    inputs = {
        dtype: tuple(torch.randn(1, 2, 24, 16, dtype=dtype, device=device) for _ in range(3))
        for dtype in DTYPES[device]
    }

    def job(i):
        def calls():  # every case, each thread starting at a different one
            return [(p, dtype, p(*inputs[dtype])) for p, dtype in cases[i % len(cases) :] + cases[: i % len(cases)]]

        return calls

    for results in _together([job(i) for i in range(THREADS)]):
        for p, dtype, out in results:
            q, k, v = inputs[dtype]
            assert_matches_reference(out, p.reference(q, k, v), p.reference(q, k, v, dtype=dtype))
    _assert_once(builds)
    assert len(builds["traces"]) == len(programs) and len(builds["plans"]) == len(cases)
    assert bool(builds["binaries"]) == (device == "cuda")


def test_decoding_and_training_threads_on_one_program(builds):
    program = _programs()[0]
    capacity, lens = 40, torch.tensor([40, 17], dtype=torch.int32)

    def decode(dtype):
        q = torch.randn(2, 4, 2, 16, dtype=dtype)
        k, v = (torch.randn(2, 2, capacity, 16, dtype=dtype) for _ in range(2))

        def step():
            out = program(q, k, v, kv_lens=lens)
            assert_matches_reference(
                out, program.reference(q, k, v, kv_lens=lens), program.reference(q, k, v, kv_lens=lens, dtype=dtype)
            )

        return step

    def train(dtype):
        q, k, v = (torch.randn(1, 2, 24, 16, dtype=dtype, requires_grad=True) for _ in range(3))
        dout = torch.randn(1, 2, 24, 16, dtype=dtype)

        def step():
            got = torch.autograd.grad(program(q, k, v), (q, k, v), dout)
            want64 = torch.autograd.grad(program.reference(q, k, v), (q, k, v), dout.double())
            want_lowp = torch.autograd.grad(program.reference(q, k, v, dtype=dtype), (q, k, v), dout)
            for name, a, b, c in zip(("dq", "dk", "dv"), got, want64, want_lowp):
                assert_matches_reference(a, b, c, what=name)

        return step

    _together([maker(dtype) for dtype in DTYPES["cpu"] for maker in (decode, train) for _ in range(THREADS // 4)])
    _assert_once(builds)
    assert len(builds["traces"]) == 1


def test_lru_cache_builds_a_key_once_while_other_keys_build():
    cache = LRUCache(4)
    building, release = threading.Event(), threading.Event()
    built = Counter()

    def build(key, fail):
        built[key] += 1
        if built[key] == 1:  # the first build of each key waits until released, then fails if told to
            building.set()
            release.wait()
            if fail:
                raise ValueError(key)
        return [key, built[key]]

    for key, fail in (("a", False), ("b", True)):
        building.clear(), release.clear()
        got = []

        def ask():
            try:
                got.append(cache.get_or_build(key, lambda: build(key, fail)))
            except ValueError as exc:
                got.append(exc)

        threads = [threading.Thread(target=ask) for _ in range(5)]
        threads[0].start()
        building.wait()
        assert cache.get_or_build("other", lambda: ["other"]) == ["other"]  # not held up by the build under way
        for t in threads[1:]:
            t.start()
        release.set()
        for t in threads:
            t.join()
        # built once, and shared; after a failed build (its error to its own caller) one waiting thread built
        # it again, and the others share that value
        values = [v for v in got if not isinstance(v, ValueError)]
        assert built[key] == 1 + fail and len(values) == 5 - fail and all(v is cache.get(key) for v in values)
