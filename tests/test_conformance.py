"""The property fuzzer: programs drawn from every registered combinator (third-party ones included) match
the float64 reference. Under Triton's interpreter on CPU in CI; natively, with more examples, on a GPU."""

import pytest

import attnfuse as af
from attnfuse.testing import check_combinator
from attnfuse.testing.strategies import drawable

from conftest import CUDA, fuzz_examples


def _checkable(name: str):
    """The kit cannot draw the parameters of a combinator that has required ones and no examples (a form
    deprecated since 2026-12-01; tests/legacy_plugin's mask is one): its own tests check it."""
    if drawable(af.combinators()[name].combinator):
        return name
    return pytest.param(
        name,
        marks=pytest.mark.skip(
            reason=f"{name} declares no examples for its required parameters (deprecated); the kit cannot draw them"
        ),
    )


@pytest.mark.parametrize("name", [_checkable(n) for n in sorted(af.combinators())])
def test_combinator_conforms(name):
    if CUDA:
        check_combinator(name, max_examples=fuzz_examples(6, 60), max_n=300, head_dims=(16, 32, 64, 80, 96, 128, 256))
    else:
        check_combinator(name, max_examples=fuzz_examples(6, 60))


def test_the_kit_runs_qk_transforms_hoisted_into_passes_too(transform_passes):
    """Short shapes never hoist on their own: the kit hoists in some examples, so a transform plugin's fragment
    is checked in the passes (its rows transformed once, the gradient carried back) as long calls run it."""
    from attnfuse.runtime import hoisted

    setting = hoisted.HOIST_MIN_QUERY_BLOCKS
    check_combinator("rope", max_examples=12, seed=5, fixed=False)
    assert transform_passes, "no example ran the transform passes"
    assert hoisted.HOIST_MIN_QUERY_BLOCKS == setting  # the runtime's setting is back after the kit
