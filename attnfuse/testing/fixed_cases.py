"""The kit's fixed cases: one program using a combinator, run on every kind of call a fragment can get wrong,
deterministically, so that such a bug fails every run rather than the runs whose draws happen to reach it.

The program is the combinator with ``softmax`` (unless it is the normaliser) over ``scaled_dot_product`` (unless
it is a score source), so every part of its fragment shows in the output: scores of both signs reach the output
(``relu_attention`` would zero the negative ones), and each row keeps several keys. Its parameters are the first
of Hypothesis's draws from a fixed seed, past the minimal one (a one-key window, rope with unrotated keys), under
which most query rows keep at least two keys, and, where there is one, none of its boolean parameters is False
(a switched-off part of the fragment: rope's ``rotate_keys``).
"""

from __future__ import annotations

import contextlib

import torch
from attrs import frozen
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from ..combinator import Role
from ..plugin_manager import combinators
from .plan_settings import transforms_hoisted
from .program_case import add_note, check_program_case, show_extras
from .strategies import ProgramCase, Shape, case_of

DRAWS = 8
FIXED_SEED = 0  # the draws' seed: the same cases whatever the source's layout or the caller's settings
"""Derandomized parameter draws the fixed cases choose from."""


@frozen(kw_only=True)
class FixedCall:
    """One kind of call: its shape and how the keys are given (``check_program_case``'s options)."""

    what: str
    shape: Shape
    grads: bool = False
    kv_lens: tuple[int, ...] | None = None
    page_size: int | None = None
    positions: tuple[int, int, int] | None = None  # q_offset, k_offset, seq_len
    dropout_p: float = 0.0  # attention dropout, its mask replayed by the reference
    packed: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # documents' query and key lengths (B = 1)
    hoisted: bool = False  # qk transforms hoisted into passes, as long calls run them


FIXED_CALLS = (
    FixedCall(
        what="prefill with gradients, GQA, Nq != Nk",
        shape=Shape(B=2, Hq=4, Hkv=2, Nq=37, Nk=45, D=32, DV=32),
        grads=True,
    ),
    FixedCall(
        what="5 queries on a KV cache filled below its capacity (split-KV)",
        shape=Shape(B=2, Hq=4, Hkv=2, Nq=5, Nk=45, D=32, DV=32),
        kv_lens=(29, 41),
    ),
    FixedCall(
        what="one-query decode step on a paged cache",
        shape=Shape(B=2, Hq=4, Hkv=2, Nq=1, Nk=48, D=32, DV=32),
        kv_lens=(33, 20),
        page_size=16,
    ),
    FixedCall(
        what="a chunk of queries at position offsets",
        shape=Shape(B=2, Hq=4, Hkv=2, Nq=21, Nk=45, D=32, DV=32),
        positions=(10, 0, 45),
    ),
    FixedCall(
        what="prefill with attention dropout and gradients, GQA, Nq != Nk",
        shape=Shape(B=2, Hq=4, Hkv=2, Nq=37, Nk=45, D=32, DV=32),
        grads=True,
        dropout_p=0.3,
    ),
    FixedCall(
        what="packed documents (lengths 0 and 1 among them) with gradients, GQA, qk transforms hoisted into passes",
        shape=Shape(B=1, Hq=4, Hkv=2, Nq=37, Nk=46, D=32, DV=32),
        grads=True,
        packed=((7, 0, 1, 20, 9), (9, 3, 1, 24, 9)),
        hoisted=True,
    ),
)


def fixed_program(name: str, shape: Shape) -> ProgramCase:
    """The fixed program of combinator ``name`` for ``shape`` (see the module's docstring)."""
    comb = combinators()[name].combinator
    chosen = {role: [] for role in Role}
    chosen[Role.SCORE_SOURCE] = [combinators()["scaled_dot_product"].combinator]
    chosen[Role.NORMALISER] = [combinators()["softmax"].combinator]
    chosen[comb.role] = [comb]
    cases: list[ProgramCase] = []

    @seed(FIXED_SEED)  # not derandomize, whose draws follow this function's source text
    @settings(
        max_examples=DRAWS,
        database=None,
        deadline=None,
        phases=(Phase.generate,),
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data())
    def draw(data):
        cases.append(case_of(data.draw, chosen, shape))

    draw()
    lively = [c for c in cases[1:] if _keys_per_row(c) >= 2]
    return ([c for c in lively if "=False" not in c.text] or lively or cases[1:] or cases)[0]


def _keys_per_row(case: ProgramCase) -> float:
    """The median number of keys with weight in a row of ``case``'s float64 reference (one sequence, head 0)."""
    s = case.shape
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(s.B, s.Hq, s.Nq, s.D, generator=g), torch.randn(s.B, s.Hkv, s.Nk, s.D, generator=g)
    eye = torch.eye(s.Nk).expand(s.B, s.Hkv, s.Nk, s.Nk)  # out = the weights themselves
    with torch.no_grad():
        weights = case.program.reference(q, k, eye, dtype=torch.float64, **case.extras)
    return (weights[:, 0] != 0).sum(-1).double().median().item()


def check_fixed_cases(name: str, device: str) -> None:
    """Run the fixed program of ``name`` on each of ``FIXED_CALLS`` in float32 (the prefills with gradients):
    a wrong backward, a fragment reading the capacity for the length, a fact wrong only for a decode step
    or a chunk, a normaliser whose weights dropout does not reach as SDPA's would, a ``prepare`` that takes a
    packed call's totals for a document's lengths, a transform wrong in the passes, fails every run."""
    __tracebackhide__ = True
    comb = combinators()[name].combinator
    for call in FIXED_CALLS:
        if call.positions is not None and comb.prepare is not None and not comb.takes_offsets:
            continue  # such a call refuses it (it does not declare takes_offsets)
        case = fixed_program(name, call.shape)
        try:
            with transforms_hoisted() if call.hoisted else contextlib.nullcontext():
                check_program_case(
                    case,
                    torch.float32,
                    device,
                    seed=0,
                    grads=call.grads,
                    kv_lens=None if call.kv_lens is None else list(call.kv_lens),
                    page_size=call.page_size,
                    positions=call.positions,
                    packed=None if call.packed is None else tuple(list(n) for n in call.packed),
                    dropout_p=call.dropout_p,
                )
        except Exception as exc:
            add_note(
                exc,
                f"fixed case ({call.what}): {case.text}, shape {call.shape}, float32, seed 0"
                f"{''.join(_options(call))}; extras: {show_extras(case.extras, False)}",
            )
            raise


def _options(call: FixedCall) -> list[str]:
    """The options ``call`` sets, each as ", name value" (gradients: ", with gradients")."""
    given = [("kv_lens", call.kv_lens), ("page_size", call.page_size), ("positions", call.positions)]
    given += [("dropout_p", call.dropout_p or None), ("packed", call.packed)]
    return (
        [", with gradients"] * call.grads
        + [f", {name} {value}" for name, value in given if value is not None]
        + [", qk transforms hoisted"] * call.hoisted
    )
