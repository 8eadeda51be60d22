"""Conformance: fused kernels against the float64 reference, over programs drawn by Hypothesis."""
from __future__ import annotations

import atexit
import contextlib
import os
import random
import shutil
import sys
import tempfile

import hypothesis
import torch
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

from ..combinator import REQUIRED
from ..passes.fuse import fuse
from ..passes.lower import instance
from ..errors import PluginError
from ..plugin_manager import broken_plugins, combinators
from ..runtime.source_cache import CACHE_ENV
from .grad_bounds import delta_rounding
from .mask_facts import check_mask_facts
from .strategies import ProgramCase, Shape, describe, drawable, pool, program_cases, shapes
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
    __tracebackhide__ = True  # pytest: a failure is its message, not this frame's tensors
    q, k, v = case.inputs(dtype, device, seed)
    extras = dict(case.extras_on(device))
    if kv_lens is not None:
        extras["kv_lens"] = torch.tensor(kv_lens, dtype=torch.int32, device=device)
    graph = case.program.graph(**{n: x for n, x in extras.items() if n != "kv_lens"})
    norm = graph.weights.apply.fragment()
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
        if lse.dtype != (torch.float64 if dtype == torch.float64 else torch.float32):
            raise AssertionError(f"lse of {case.text}: dtype {lse.dtype} for {dtype} inputs")
        assert_matches_reference(lse, ref64[1], ref_lowp[1], dtype, what=f"lse of {case.text}")
    if not can_grad:
        return
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(out.shape, generator=g).to(dtype).to(device)
    got = torch.autograd.grad(out, leaves, dout)
    _synchronize(device)
    rounding = [None] * len(leaves)
    if norm.needs_delta:
        with torch.no_grad():
            abs_weighted_v = case.program.reference(q.detach(), k.detach(), v.detach().abs(), return_lse=True,
                                                    dtype=torch.float64, **extras)[0]
        rounding = delta_rounding(ref64[1], ref64[0], abs_weighted_v, dout, leaves, dtype)
    want64 = torch.autograd.grad(ref64[0], leaves, dout.to(torch.float64))
    want_lowp = torch.autograd.grad(ref_lowp[0], leaves, dout)
    scores = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
    summed = [1, 1, 1, *(scores // extras[n].numel() for n in grad_extras)]
    names = ["dq", "dk", "dv", *(f"d{n}" for n in grad_extras)]
    for name, a, b, c, n, r in zip(names, got, want64, want_lowp, summed, rounding):
        assert_matches_reference(a, b, c, dtype, what=f"{name} of {case.text}", summed=n, rounding=r)


def check_combinator(name: str | None = None, *, device: str | None = None,
                     dtypes: tuple[torch.dtype, ...] | None = None, max_examples: int = 20, max_n: int = 80,
                     head_dims: tuple[int, ...] = (16, 32, 64, 80, 128), installed: bool = False,
                     seed: int | None = None, show_tensors: bool = False) -> None:
    """Check combinator ``name`` (every registered one when None): a mask's keep and facts, deterministically
    over enumerated problems (``mask_facts``); then, as a property test, programs using it match the float64
    reference, forward and, for about half the examples, backward.

    Programs combine it with the built-ins (``installed=True``: with every registered combinator). Kernels
    are cached in a temporary directory unless ``ATTNFUSE_CACHE_DIR`` is set. A failure says how to replay
    it: the seed to pass back, the drawn program, shape and parameters (``show_tensors``: the extra tensors
    in full).
    """
    __tracebackhide__ = True
    registry = combinators()
    if name is not None and name not in registry:
        raise PluginError(f"check_combinator: no combinator named {name!r} is registered{_broken_note()}")
    if name is not None and not drawable(registry[name].combinator):
        required = [p.name for p in registry[name].combinator.params if p.default is REQUIRED]
        raise PluginError(f"check_combinator: combinator {name!r} declares no examples(draw, shape), so the kit "
                          f"cannot draw its parameters {required}, which have no default; declare examples")
    if name is None or installed:
        _fail_on_broken()
    for mask in ([name] if name is not None else sorted(n for n, r in registry.items() if drawable(r.combinator))):
        check_mask_facts(mask)
    device = device or default_device()
    dtypes = dtypes or default_dtypes(device)
    names = pool(name, installed or name is None)
    seed = random.randrange(2**32) if seed is None else seed

    @hypothesis.seed(seed)
    @settings(max_examples=max_examples, deadline=None, database=None, phases=_PHASES, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def conforms(data):
        __tracebackhide__ = True
        shape = data.draw(shapes(max_n=max_n, head_dims=head_dims), label="shape")
        case = data.draw(program_cases(shape, include=name, names=names), label="program")
        note(f"program: {case.text}")
        note(f"extras: {_show(case.extras, show_tensors)}")
        dtype = data.draw(st.sampled_from(dtypes), label="dtype")
        kv_lens = None
        if shape.Nq <= shape.Nk and data.draw(st.booleans(), label="kv cache"):
            kv_lens = data.draw(st.lists(st.integers(shape.Nq, shape.Nk), min_size=shape.B, max_size=shape.B),
                                label="kv_lens")
        check_program_case(case, dtype, device, seed=data.draw(st.integers(0, 2**31 - 1), label="seed"),
                           grads=data.draw(st.booleans(), label="grads"), kv_lens=kv_lens)

    with temporary_cache():
        try:
            if name is not None:
                check_fixed_case(name, names, device)
            conforms()
        except Exception as exc:
            _add_note(exc, f"replay: check_combinator({name!r}, seed={seed}, max_examples={max_examples}, "
                         f"installed={installed}, device={device!r}, show_tensors=True)")
            raise


FIXED_SHAPE = Shape(B=2, Hq=2, Hkv=1, Nq=37, Nk=45, D=32, DV=32)


def check_fixed_case(name: str, names: tuple[str, ...], device: str) -> None:
    """One deterministic program using ``name`` (the first Hypothesis draws for a fixed shape), forward and
    backward in float32, so that a wrong backward fails every run, not only runs that happen to draw
    gradients."""
    __tracebackhide__ = True
    cases: list[ProgramCase] = []

    @settings(max_examples=1, derandomize=True, database=None, deadline=None, phases=(Phase.generate,),
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def draw(data):
        cases.append(data.draw(program_cases(FIXED_SHAPE, include=name, names=names, max_mods=1, max_masks=1)))

    draw()
    try:
        check_program_case(cases[0], torch.float32, device, seed=0, grads=True)
    except Exception as exc:
        _add_note(exc, f"fixed case: {cases[0].text}, shape {FIXED_SHAPE}, float32, seed 0, with gradients; "
                     f"extras: {_show(cases[0].extras, False)}")
        raise


def _add_note(exc: BaseException, note_text: str) -> None:
    """Attach replay information to a failure (Python 3.11's notes; printed on older Pythons)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note_text)
    else:
        print(note_text, file=sys.stderr)


def _show(extras: dict, full: bool) -> str:
    if not full:
        return describe(extras) or "none"
    with _full_print():
        return "\n".join(f"{n} = {v!r}" for n, v in extras.items()) or "none"


@contextlib.contextmanager
def _full_print():
    torch.set_printoptions(profile="full")
    try:
        yield
    finally:
        torch.set_printoptions(profile="default")


_temporary_root: list[str] = []


@contextlib.contextmanager
def temporary_cache():
    """Kernels go to a temporary directory (one per process, removed at exit: kernels loaded from it stay
    in use) for the duration, unless the user set ``ATTNFUSE_CACHE_DIR``."""
    if os.environ.get(CACHE_ENV):
        yield
        return
    if not _temporary_root:
        _temporary_root.append(tempfile.mkdtemp(prefix="attnfuse-conformance-"))
        atexit.register(shutil.rmtree, _temporary_root[0], ignore_errors=True)
    os.environ[CACHE_ENV] = _temporary_root[0]
    try:
        yield
    finally:
        os.environ.pop(CACHE_ENV, None)


def _broken_note() -> str:
    broken = broken_plugins()
    return "" if not broken else "; broken plugins were skipped: " + "; ".join(b.describe() for b in broken)


def _fail_on_broken() -> None:
    if broken_plugins():
        raise PluginError("broken plugins: " + "; ".join(b.describe() for b in broken_plugins()))
