"""The RecompileWarning's advice follows the combinators' declarations: an extra argument that feeds a static
parameter is said to be static only (naming the combinator and parameter), never told to become a tensor; one
that may be a runtime input is told so."""

from __future__ import annotations

import warnings

import pytest

import attnfuse as af
from attnfuse import RecompileWarning, recompile


STATIC = [  # (combinator, parameter, a program of one extra argument x, x's i-th value)
    (
        "scaled_dot_product",
        "scale",
        lambda q, k, v, x: af.softmax(af.scaled_dot_product(q, k, scale=x)) @ v,
        lambda i: 0.1 + i / 16,
    ),
    ("rope", "theta", lambda q, k, v, x: af.softmax(af.rope(q, k, theta=x)) @ v, lambda i: 1000.0 + i),
    ("rope", "scale", lambda q, k, v, x: af.softmax(af.rope(q, k, scale=x)) @ v, lambda i: 0.1 + i / 16),
    (
        "sliding_window",
        "left",
        lambda q, k, v, x: af.softmax(af.sliding_window(af.scaled_dot_product(q, k), x)) @ v,
        lambda i: i,
    ),
    (
        "sliding_window",
        "right",
        lambda q, k, v, x: af.softmax(af.sliding_window(af.scaled_dot_product(q, k), 2, right=x)) @ v,
        lambda i: i,
    ),
    (
        "softcap",
        "cap",
        lambda q, k, v, x: af.softmax(af.softcap(af.scaled_dot_product(q, k), x)) @ v,
        lambda i: 1.0 + i,
    ),
    (
        "sigmoid_attention",
        "bias",  # a third-party plugin (contrib/attnfuse-sigmoid)
        lambda q, k, v, x: af.sigmoid_attention(af.scaled_dot_product(q, k), bias=x) @ v,
        lambda i: -1.0 - i,
    ),
]


def _warning(program, values) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RecompileWarning)
        for value in values:
            program.graph(value)
    (warning,) = [w for w in caught if w.category is RecompileWarning]
    return str(warning.message)


@pytest.mark.parametrize("combinator, param, body, value", STATIC, ids=[f"{c}.{p}" for c, p, _, _ in STATIC])
def test_an_argument_feeding_a_static_parameter_is_never_told_to_be_a_tensor(combinator, param, body, value):
    message = _warning(af.attention(body), [value(i) for i in range(recompile.RECOMPILE_LIMIT + 1)])
    assert "changing: 'x'." in message
    assert f"'x' can only be static ({combinator}: parameter {param!r} is static" in message
    assert "tensor argument" not in message and "may be a runtime input" not in message
    assert message.endswith("Use fewer distinct values, or raise attnfuse.recompile.RECOMPILE_LIMIT")


def test_an_argument_used_in_python_is_static_only():
    def prog(q, k, v, x):
        return af.softmax(af.sliding_window(af.scaled_dot_product(q, k), int(x) * 2)) @ v

    message = _warning(af.attention(prog), range(recompile.RECOMPILE_LIMIT + 1))
    assert "'x' can only be static (" in message and "tensor argument" not in message


def test_an_argument_that_may_be_a_runtime_input_is_told_so():
    """``x`` reaches no static parameter (here: no combinator) in this configuration: it may be a tensor."""

    def prog(q, k, v, x, left):
        return af.softmax(af.sliding_window(af.scaled_dot_product(q, k), left)) @ v

    program = af.attention(prog)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RecompileWarning)
        for i in range(recompile.RECOMPILE_LIMIT + 1):
            program.graph(0.5 + i, i)
    (message,) = [str(w.message) for w in caught if w.category is RecompileWarning]
    assert "changing: 'x', 'left'." in message
    assert "'x' may be a runtime input: pass it as a tensor argument and a new value compiles nothing." in message
    assert "'left' can only be static (sliding_window: parameter 'left' is static" in message
