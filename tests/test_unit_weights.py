"""``NormaliserFragment.unit_weights``: a CPU call asserts it after every update (``DeclarationViolation`` naming the
normaliser, the interpreter's settings restored after), only for a normaliser that declares it; the built-ins
declare it (the conformance kit checks that it holds, ``attnfuse.testing.unit_weights``)."""

from __future__ import annotations

import attrs
import pytest
import torch

import attnfuse as af
from attnfuse.plugin import DeclarationViolation
from attnfuse.testing.planted_bugs import planted
from attnfuse.triton_compat import interpreter

BUILTIN_NORMALISERS = ("softmax", "softmax_with_sinks", "relu_attention")


def _relu_without_its_maximum(name: str, declared: bool) -> af.Combinator:
    """The planted bug ``unit_weights_unkept`` (relu_attention's weights relu(s) / Nk with no running maximum: the
    same out, weights above 1 on scores above the key count), declaring ``unit_weights`` or not."""
    comb = planted("unit_weights_unkept")
    return attrs.evolve(comb, name=name, fragment=attrs.evolve(comb.fragment, unit_weights=declared))


@pytest.fixture
def registered():
    names = []

    def register(comb: af.Combinator) -> None:
        class Plugin:
            @af.hookimpl
            def attnfuse_combinators(self):
                return [comb]

        af.register_plugin(Plugin(), name=f"test-unit-weights:{comb.name}")
        names.append(f"test-unit-weights:{comb.name}")

    yield register
    for name in names:
        af.unregister_plugin(name)


def _call(name: str, seed: int):
    """``name``(scaled_dot_product) @ v on scores well above the key count (q, k times 8: |s| up to ~100 over 3
    keys), its output and the float64 reference's."""
    normaliser = getattr(af, name)
    program = af.attention(lambda q, k, v: normaliser(af.scaled_dot_product(q, k)) @ v)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (4, 3, 3))
    q, k = q * 8, k * 8
    return program(q, k, v), program.reference(q, k, v, dtype=torch.float64)


def test_a_false_declaration_fails_a_cpu_call_by_name_and_the_interpreter_is_restored(registered):
    registered(_relu_without_its_maximum("_test_unit_declared", declared=True))
    before = interpreter.interpreter_builder.options
    with pytest.raises(DeclarationViolation, match=r"normaliser '_test_unit_declared' declares unit_weights=True"):
        _call("_test_unit_declared", seed=0)
    assert interpreter.interpreter_builder.options is before and not before.debug


def test_an_undeclared_normaliser_is_not_asserted_and_computes_as_before(registered):
    registered(_relu_without_its_maximum("_test_unit_undeclared", declared=False))
    out, reference = _call("_test_unit_undeclared", seed=1)
    assert reference.abs().max() > 1  # weights above 1 reached out
    torch.testing.assert_close(out.double(), reference, rtol=1e-4, atol=1e-4)


def test_the_builtin_normalisers_declare_unit_weights():
    """The float8 forward template relies on it (the conformance kit checks that it holds: ``check_unit_weights``)."""
    assert all(af.combinators()[name].combinator.fragment.unit_weights for name in BUILTIN_NORMALISERS)
