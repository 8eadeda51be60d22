"""Conformance: fused kernels against the float64 reference, over programs drawn by Hypothesis."""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import shutil
import tempfile

import hypothesis
import torch
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

from ..combinator import REQUIRED
from ..errors import PluginError
from ..plugin_manager import broken_plugins, combinators
from ..runtime.source_cache import CACHE_ENV
from .fixed_cases import check_fixed_cases
from .mask_facts import check_mask_facts
from .plan_settings import transforms_hoisted
from .program_case import add_note, check_program_case, show_extras
from .strategies import documents, drawable, pool, program_cases, shapes
from .unit_weights import check_unit_weights


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


def check_combinator(
    name: str | None = None,
    *,
    device: str | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    max_examples: int = 20,
    max_n: int = 80,
    head_dims: tuple[int, ...] = (16, 32, 64, 80, 128),
    installed: bool = False,
    seed: int | None = None,
    show_tensors: bool = False,
    fixed: bool = True,
) -> None:
    """Check combinator ``name`` (every registered one when None): a mask's keep and facts, deterministically
    over enumerated problems (``mask_facts``); a normaliser's ``unit_weights`` on large scores
    (``unit_weights``); its fixed program on every kind of call (``fixed_cases``);
    then, as a property test, programs using it match the float64 reference, forward and, for about half the
    examples, backward; qk transforms run in the kernels or, in about half the examples, hoisted into passes
    (as long calls run them). ``fixed=False`` leaves out the deterministic checks (facts, fixed cases), which
    give the same verdict on every run: for repeated runs with other seeds.

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
        raise PluginError(
            f"check_combinator: combinator {name!r} declares no examples(draw, shape), so the kit "
            f"cannot draw its parameters {required}, which have no default; declare examples"
        )
    if name is None or installed:
        _fail_on_broken()
    checked = [name] if name is not None else sorted(n for n, r in registry.items() if drawable(r.combinator))
    for each in checked if fixed else ():
        check_mask_facts(each)
    device = device or default_device()
    dtypes = dtypes or default_dtypes(device)
    names = pool(name, installed or name is None)
    seed = random.randrange(2**32) if seed is None else seed

    @hypothesis.seed(seed)
    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        phases=_PHASES,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(data=st.data())
    def conforms(data):
        __tracebackhide__ = True
        shape = data.draw(shapes(max_n=max_n, head_dims=head_dims), label="shape")
        case = data.draw(program_cases(shape, include=name, names=names), label="program")
        note(f"program: {case.text}")
        note(f"extras: {show_extras(case.extras, show_tensors)}")
        dtype = data.draw(st.sampled_from(dtypes), label="dtype")
        kv_lens = None
        if shape.Nq <= shape.Nk and data.draw(st.booleans(), label="kv cache"):
            kv_lens = data.draw(
                st.lists(st.integers(shape.Nq, shape.Nk), min_size=shape.B, max_size=shape.B), label="kv_lens"
            )
        packed = None
        if kv_lens is None and shape.B == 1 and shape.Nq <= shape.Nk and data.draw(st.booleans(), label="packed"):
            packed = data.draw(documents(shape.Nq, shape.Nk), label="documents")
        hoisted = kv_lens is None and data.draw(st.booleans(), label="qk transforms hoisted into passes")
        with transforms_hoisted() if hoisted else contextlib.nullcontext():
            check_program_case(
                case,
                dtype,
                device,
                seed=data.draw(st.integers(0, 2**31 - 1), label="seed"),
                grads=data.draw(st.booleans(), label="grads"),
                kv_lens=kv_lens,
                packed=packed,
            )

    with temporary_cache():
        try:
            for each in checked if fixed else ():
                check_unit_weights(each)
            if name is not None and fixed:
                check_fixed_cases(name, device)
            conforms()
        except Exception as exc:
            add_note(
                exc,
                f"replay: check_combinator({name!r}, seed={seed}, max_examples={max_examples}, "
                f"installed={installed}, device={device!r}, dtypes={dtypes}, show_tensors=True)",
            )
            raise


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
