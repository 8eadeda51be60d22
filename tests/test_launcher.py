"""The fast launch path: its specialisation keys are never coarser than Triton's own."""

import itertools

import pytest
import torch
import triton
import triton.language as tl
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from attnfuse.runtime.launcher import Launcher, call_key


def _triton_key(arg):
    return native_specialize_impl(BaseBackend, arg, False, True, True)


def _descriptors():
    """TMA descriptors as the forward template's instances make them: two tiles, two dtypes, two head dims."""
    from attnfuse.kernels.descriptors import describe

    rows = torch.randn(2, 4, 256, 128)
    return [describe(t, tile) for t in (rows.bfloat16(), rows.half(), rows[..., :64].bfloat16()) for tile in (64, 128)]


def test_keys_are_at_least_as_fine_as_tritons():
    base = torch.randn(64)
    values = [
        0,
        1,
        2,
        3,
        15,
        16,
        17,
        32,
        48,
        1000,
        1024,
        -1,
        -16,
        2**31 - 16,
        2**31 - 1,
        2**31,
        2**31 + 16,
        2**40,
        -(2**31),
        -(2**31) - 1,
        2**63 - 16,
        2**63,
        0.5,
        1.0,
        True,
        False,
        None,
        base,
        base[1:],
        base[4:],
        base.half(),
        base.half()[8:],
        base.double(),
        *_descriptors(),
    ]
    for a, b in itertools.combinations(values, 2):
        if call_key((a,)) == call_key((b,)):
            assert _triton_key(a) == _triton_key(b), (a, b)


def test_constexprs_must_come_last():
    def kernel(X, BLOCK: tl.constexpr, n):
        pass

    with pytest.raises(ValueError, match="constexpr parameters must come after"):
        Launcher(triton.jit(kernel))


def test_interpreter_checks_bounds():
    """Under the interpreter an access outside every tensor argument raises, as it would fault on a GPU."""
    from attnfuse.runtime.interpreter import InterpretedKernel

    def copy(X, Y, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(Y + i, tl.load(X + i, mask=i < n), mask=i < n)

    x, y = torch.randn(8), torch.empty(8)
    InterpretedKernel(copy).launch((1,), (x, y, 8), {"BLOCK": 16})
    assert torch.equal(x, y)
    with pytest.raises(IndexError, match="out-of-bounds load"):
        InterpretedKernel(copy).launch((1,), (x, y[:4], 12), {"BLOCK": 16})


def test_launch_hooks_are_seen():
    from triton import knobs

    from attnfuse.runtime.launcher import _hooked

    assert not _hooked(None)
    assert not _hooked(knobs.runtime.launch_enter_hook)  # Triton's empty chain: no hook installed

    def hook(metadata):
        pass

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert _hooked(knobs.runtime.launch_enter_hook)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)


def _language_state() -> dict:
    """Every attribute of the modules and classes Triton's interpreter patches (Python adds
    ``__annotations__`` to a class on first access, so that one is left out)."""
    owners = (tl, tl.core, tl.math, tl.tensor, tl.core.tensor_descriptor_base)
    return {
        (id(o), name): getattr(o, name)
        for o in owners
        for name in dir(o)
        if name not in ("__annotations__", "__dict__")
    }


def test_interpreter_leaves_triton_language_as_it_found_it():
    """An interpreted kernel that calls ``@triton.jit`` helpers (tl.sum, tl.max, tl.cdiv ...) restores every
    patch when it returns, even when it raises: a later real compilation must see Triton's own functions."""
    from attnfuse.runtime.interpreter import InterpretedKernel

    def row_stats(X, Y, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        x = tl.load(X + i, mask=i < n, other=0.0)
        tl.store(Y + tl.arange(0, 2), tl.where(tl.arange(0, 2) == 0, tl.sum(x, axis=0), tl.max(x, axis=0)))

    before = _language_state()
    x, y = torch.randn(8, generator=torch.Generator().manual_seed(0)), torch.empty(2)
    InterpretedKernel(row_stats).launch((1,), (x, y, 8), {"BLOCK": 8})
    assert torch.allclose(y, torch.stack([x.sum(), x.max()]))
    assert _language_state() == before
    with pytest.raises(IndexError):
        InterpretedKernel(row_stats).launch((1,), (x, torch.empty(1), 8), {"BLOCK": 8})
    assert _language_state() == before


def test_interpreted_helpers_share_the_kernels_patches(monkeypatch):
    """A kernel that calls a ``@triton.jit`` helper on every step of a loop patches ``triton.language`` once
    for itself and once for the modules its helpers see (``tl.core``), not once per call: entering the patches
    costs milliseconds, and a kernel's helpers are called for every program and step."""
    from attnfuse.runtime import interpreter

    patches = []
    original = interpreter._patch_lang
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: patches.append(fn) or original(fn))

    def running_max(X, Y, STEPS: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        best = tl.max(tl.load(X + i), axis=0)
        for step in range(1, STEPS):
            best = tl.maximum(best, tl.max(tl.load(X + step * BLOCK + i), axis=0))
        tl.store(Y + tl.program_id(0), best)

    x, y = torch.randn(6 * 8, generator=torch.Generator().manual_seed(1)), torch.empty(3)
    before = _language_state()
    interpreter.InterpretedKernel(running_max).launch((3,), (x, y), {"STEPS": 6, "BLOCK": 8})
    assert torch.equal(y, x.max().expand(3))
    assert len(patches) <= 2, [p.__name__ for p in patches]
    assert _language_state() == before
