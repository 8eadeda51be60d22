"""The testing kit: Hypothesis strategies over every registered combinator, tolerances, conformance checks.

Third-party plugins test themselves with it::

    from attnfuse.testing import check_combinator

    def test_softcap_conforms():
        check_combinator("softcap")
"""

from .conformance import check_combinator
from .program_case import check_program_case
from .strategies import ProgramCase, Shape, program_cases, random_tensor, shapes
from .tolerances import ATOL, assert_matches_reference

__all__ = [
    "ATOL",
    "ProgramCase",
    "Shape",
    "assert_matches_reference",
    "check_combinator",
    "check_program_case",
    "program_cases",
    "random_tensor",
    "shapes",
]
