"""The property fuzzer: programs drawn from every registered combinator (third-party ones included) match
the float64 reference. Under Triton's interpreter on CPU in CI; natively, with more examples, on a GPU."""
import pytest

import attnfuse as af
from attnfuse.testing import check_combinator

from conftest import CUDA, fuzz_examples


@pytest.mark.parametrize("name", sorted(af.combinators()))
def test_combinator_conforms(name):
    if CUDA:
        check_combinator(name, max_examples=fuzz_examples(6, 60), max_n=300,
                         head_dims=(16, 32, 64, 80, 96, 128, 256))
    else:
        check_combinator(name, max_examples=fuzz_examples(6, 60))
