"""The conformance kit's check of a normaliser's ``unit_weights`` declaration (``NormaliserFragment``).

The generated forward kernel asserts the declaration after each update wherever device assertions run
(``passes/codegen/scores.unit_weights_check``: under Triton's interpreter, so on every CPU call). The kit's
random scores are small (standard normal q and k), and a normaliser whose weights pass 1 only on large scores
(an exponent with no running maximum subtracted, relu without its running maximum) passes them. So this check
runs the normaliser's fixed program (``fixed_cases.fixed_program``) on scores up to thousands, over one, a few
and many keys: a false declaration fails every run with ``DeclarationViolation``, an AssertionError naming the
normaliser.
"""

from __future__ import annotations

import torch

from ..combinator import Role
from ..plugin_manager import combinators
from .fixed_cases import fixed_program
from .strategies import Shape

MAGNITUDES = (1.0, 8.0, 64.0)  # q and k multiplied by each: scores up to thousands
KEY_COUNTS = (1, 3, 40)


def check_unit_weights(name: str) -> None:
    """Run normaliser ``name``'s fixed program on CPU tensors at each of ``MAGNITUDES`` and ``KEY_COUNTS`` where
    its fragment declares ``unit_weights`` (the kernels assert it); nothing for another role."""
    if combinators()[name].combinator.role is not Role.NORMALISER:
        return
    for keys in KEY_COUNTS:
        case = fixed_program(name, Shape(B=1, Hq=2, Hkv=1, Nq=4, Nk=keys, D=16, DV=16))
        extras = case.extras_on("cpu")
        if not case.program.graph(**extras).weights.apply.fragment().unit_weights:
            continue
        q, k, v = case.inputs(torch.float32, "cpu", seed=keys)
        for magnitude in MAGNITUDES:
            case.program(q * magnitude, k * magnitude, v, **extras)
