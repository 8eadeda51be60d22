"""Conformance: fused kernels against the float64 reference, over programs drawn by Hypothesis."""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

from ..passes.fuse import fuse
from ..passes.lower import fragment_of, instance
from ..plugin_manager import combinators
from .strategies import ProgramCase, program_cases, shapes
from .tolerances import assert_matches_reference


# No shrinking: each shrink step reruns (and may recompile) kernels, which under the interpreter turns one
# failure into minutes of work. A failure is reported as drawn, with its program text.
_PHASES = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtypes(device: str) -> tuple[torch.dtype, ...]:
    """bfloat16 is wrong under Triton's interpreter, so the CPU checks float32 and float16 only."""
    if device == "cpu":
        return (torch.float32, torch.float16)
    return (torch.float16, torch.bfloat16, torch.float32)


def differentiable(case: ProgramCase, extras: dict) -> tuple[bool, tuple[str, ...]]:
    """Whether every combinator of the program declares a backward, and which extra tensors get gradients."""
    fused = fuse(case.program.graph(**{n: x for n, x in extras.items() if n != "kv_lens"}))
    grads: list[str] = []
    for i, app in enumerate(fused.applications()):
        fragment = instance(app, i).fragment
        transform = getattr(fragment, "transform", fragment)
        if hasattr(transform, "differentiable") and not transform.differentiable():
            return False, ()
        if getattr(fragment, "grad", "") is None:
            return False, ()
        for name, _ in getattr(fragment, "tensor_grads", ()):
            if name in app.inputs():
                grads.append(app.inputs()[name].name)
    return True, tuple(dict.fromkeys(grads))


def _synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def check_program_case(case: ProgramCase, dtype: torch.dtype, device: str, seed: int, grads: bool = False,
                       kv_lens: list[int] | None = None) -> None:
    """Run ``case`` fused and compare out, lse (when the normaliser has one) and, with ``grads``, the
    gradients of q, k, v and of tensor inputs with declared gradients, with the reference's. ``kv_lens``:
    per-sequence key counts (a KV cache; with at most 16 queries and no gradients, the split-KV path)."""
    q, k, v = case.inputs(dtype, device, seed)
    extras = dict(case.extras_on(device))
    if kv_lens is not None:
        extras["kv_lens"] = torch.tensor(kv_lens, dtype=torch.int32, device=device)
    graph = case.program.graph(**{n: x for n, x in extras.items() if n != "kv_lens"})
    norm = fragment_of(graph.weights.apply)
    has_lse = norm.has_lse
    can_grad, grad_extras = differentiable(case, extras) if grads else (False, ())
    if dtype in (torch.float16, torch.bfloat16) and not norm.smooth:
        can_grad = False
    leaves = [q, k, v] + [extras[n] for n in grad_extras]
    if can_grad:
        for t in leaves:
            t.requires_grad_(True)
    result = case.program(q, k, v, return_lse=has_lse, **extras)
    _synchronize(device)  # a fault in the fused kernel is reported with this example, not a later one
    out, lse = result if has_lse else (result, None)
    ref64 = case.program.reference(q, k, v, return_lse=has_lse, dtype=torch.float64, **extras)
    ref_lowp = case.program.reference(q, k, v, return_lse=has_lse, dtype=dtype, **extras)
    if not has_lse:
        ref64, ref_lowp = (ref64, None), (ref_lowp, None)
    assert_matches_reference(out, ref64[0], ref_lowp[0], dtype, what=f"out of {case.text}")
    if has_lse:
        assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert_matches_reference(lse, ref64[1], ref_lowp[1], dtype, what=f"lse of {case.text}")
    if not can_grad:
        return
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(out.shape, generator=g).to(dtype).to(device)
    got = torch.autograd.grad(out, leaves, dout)
    _synchronize(device)
    want64 = torch.autograd.grad(ref64[0], leaves, dout.to(torch.float64))
    want_lowp = torch.autograd.grad(ref_lowp[0], leaves, dout)
    scores = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
    summed = [1, 1, 1, *(scores // extras[n].numel() for n in grad_extras)]
    for name, a, b, c, n in zip(["dq", "dk", "dv", *(f"d{n}" for n in grad_extras)], got, want64, want_lowp, summed):
        assert_matches_reference(a, b, c, dtype, what=f"{name} of {case.text}", summed=n)


def check_combinator(name: str | None = None, *, device: str | None = None,
                     dtypes: tuple[torch.dtype, ...] | None = None, max_examples: int = 20, max_n: int = 80,
                     head_dims: tuple[int, ...] = (16, 32, 64, 80, 128)) -> None:
    """Property test: programs that use combinator ``name`` (any program when None) match the reference,
    forward and, for about half the examples, backward.

    Programs are composed from every registered combinator, so a plugin is checked alongside the others.
    """
    if name is not None and name not in combinators():
        raise KeyError(f"no combinator named {name!r} is registered")
    device = device or default_device()
    dtypes = dtypes or default_dtypes(device)

    @settings(max_examples=max_examples, deadline=None, database=None, phases=_PHASES,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def conforms(data):
        shape = data.draw(shapes(max_n=max_n, head_dims=head_dims), label="shape")
        case = data.draw(program_cases(shape, include=name), label="program")
        note(f"program: {case.text}")
        dtype = data.draw(st.sampled_from(dtypes), label="dtype")
        kv_lens = None
        if shape.Nq <= shape.Nk and data.draw(st.booleans(), label="kv cache"):
            kv_lens = data.draw(st.lists(st.integers(shape.Nq, shape.Nk), min_size=shape.B, max_size=shape.B),
                                label="kv_lens")
        check_program_case(case, dtype, device, seed=data.draw(st.integers(0, 2**31 - 1), label="seed"),
                           grads=data.draw(st.booleans(), label="grads"), kv_lens=kv_lens)

    conforms()
