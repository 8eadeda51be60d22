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


def test_keys_are_at_least_as_fine_as_tritons():
    base = torch.randn(64)
    values = [0, 1, 2, 3, 15, 16, 17, 32, 48, 1000, 1024, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16,
              2**40, -2**31, -2**31 - 1, 2**63 - 16, 2**63, 0.5, 1.0, True, False, None,
              base, base[1:], base[4:], base.half(), base.half()[8:], base.double()]
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
