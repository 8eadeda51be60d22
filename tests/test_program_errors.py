"""Ill-formed programs fail at trace time (their first call) with a ProgramError naming what went wrong.

None of these tests launches a kernel: tracing happens before any kernel is compiled, so every error
below is raised by the DSL itself.
"""

from __future__ import annotations

import re

import pytest
import torch

import attnfuse as af
from attnfuse import InputError, ProgramError

SHAPE = (1, 2, 8, 16)


def qkv():
    return tuple(torch.randn(SHAPE) for _ in range(3))


def _raises_at_call(fn, match: str, exc=ProgramError):
    """Decorating succeeds; the first call (the trace) raises ``exc`` matching ``match``."""
    program = af.attention(fn)
    with pytest.raises(exc, match=match):
        program(*qkv())
    return program


# --- the chain score -> masks/biases -> normaliser -> @ v ---------------------------------------------


def test_no_normaliser():
    def prog(q, k, v):
        return af.scaled_dot_product(q, k) @ v

    _raises_at_call(prog, r"no normaliser.*af\.softmax\(s\) @ v")


def test_two_normalisers():
    def prog(q, k, v):
        return af.softmax(af.softmax(af.scaled_dot_product(q, k))) @ v

    _raises_at_call(prog, r"two normalisers: softmax .*exactly one normaliser")


def test_two_different_normalisers():
    def prog(q, k, v):
        return af.relu_attention(af.softmax(af.scaled_dot_product(q, k))) @ v

    _raises_at_call(prog, r"two normalisers: relu_attention")


def test_mask_after_normaliser():
    def prog(q, k, v):
        w = af.softmax(af.scaled_dot_product(q, k))
        return af.causal(w) @ v

    _raises_at_call(prog, r"causal applied after the normaliser: masks act on scores.*before softmax")


def test_bias_after_normaliser():
    def prog(q, k, v):
        w = af.softmax(af.scaled_dot_product(q, k))
        return af.alibi(w) @ v

    _raises_at_call(prog, r"alibi applied after the normaliser: score modifications act on scores")


def test_mask_on_a_raw_tensor_symbol():
    def prog(q, k, v):
        return af.softmax(af.causal(q)) @ v

    _raises_at_call(prog, r"causal takes scores, got the query tensor q.*af\.scaled_dot_product\(q, k\)")


def test_rope_on_v():
    def prog(q, k, v):
        return af.softmax(af.rope(q, v)) @ v

    _raises_at_call(prog, r"rope\(q, k\): its second argument must be the key tensor k, got the value tensor v")


def test_rope_arguments_swapped():
    def prog(q, k, v):
        return af.softmax(af.rope(k, q)) @ v

    _raises_at_call(prog, r"rope\(q, k\): its first argument must be the query tensor q, got the key tensor k")


def test_scaled_dot_product_on_v():
    def prog(q, k, v):
        return af.softmax(af.scaled_dot_product(v, k)) @ v

    _raises_at_call(
        prog,
        r"scaled_dot_product\(q, k\): its first argument must be the query tensor q, "
        r"got the value tensor v",
    )


def test_returning_weights_without_at_v():
    def prog(q, k, v):
        return af.softmax(af.scaled_dot_product(q, k))

    _raises_at_call(prog, r"returns weights with no `@ v`.*af\.softmax\(s\) @ v")


def test_returning_scores():
    def prog(q, k, v):
        return af.causal(af.scaled_dot_product(q, k))

    _raises_at_call(prog, r"returns scores: it needs a normaliser and `@ v`")


def test_returning_something_else():
    def prog(q, k, v):
        return q

    _raises_at_call(prog, r"must return `weights @ v`, got the query tensor q")


def test_weights_at_q_not_v():
    def prog(q, k, v):
        return af.softmax(af.scaled_dot_product(q, k)) @ q

    _raises_at_call(prog, r"weights @ v: the right operand must be the value tensor v.*got the query tensor q")


def test_weights_at_concrete_tensor():
    value = torch.randn(SHAPE)

    def prog(q, k, v):
        return af.softmax(af.scaled_dot_product(q, k)) @ value

    _raises_at_call(
        prog,
        r"prog reads the closure variable 'value', which holds a Tensor.*pass 'value' as an "
        r"argument of the program",
    )


# --- plain tensor operations on symbols ----------------------------------------------------------------

NOT_DSL = r"not part of the AttnFuse DSL: a program may only apply combinators"


def test_multiply_scores():
    def prog(q, k, v):
        s = af.scaled_dot_product(q, k)
        return af.softmax(s * 2) @ v

    _raises_at_call(prog, r"the operator \* on the scores is " + NOT_DSL)


def test_add_to_scores():
    def prog(q, k, v):
        s = af.scaled_dot_product(q, k)
        return af.softmax(s + 1) @ v

    _raises_at_call(prog, r"the operator \+ on the scores is " + NOT_DSL)


def test_reflected_operator_on_scores():
    def prog(q, k, v):
        s = af.scaled_dot_product(q, k)
        return af.softmax(1 - s) @ v

    _raises_at_call(prog, r"the operator - on the scores is " + NOT_DSL)


@pytest.mark.filterwarnings("ignore:Defining your `__torch_function__` as a plain method")
def test_torch_function_on_scores():
    def prog(q, k, v):
        s = af.scaled_dot_product(q, k)
        return af.softmax(torch.exp(s)) @ v

    _raises_at_call(prog, r"torch\.exp on the scores is " + NOT_DSL)


@pytest.mark.filterwarnings("ignore:Defining your `__torch_function__` as a plain method")
def test_torch_function_on_q():
    def prog(q, k, v):
        return af.softmax(af.scaled_dot_product(torch.tanh(q), k)) @ v

    _raises_at_call(prog, r"torch\.tanh on the query tensor q is " + NOT_DSL)


def test_truth_test_on_scores():
    def prog(q, k, v):
        s = af.scaled_dot_product(q, k)
        if s:
            s = af.causal(s)
        return af.softmax(s) @ v

    _raises_at_call(prog, r"a truth test \(if/while/and/or\) on the scores is " + NOT_DSL)


def test_indexing_weights():
    def prog(q, k, v):
        w = af.softmax(af.scaled_dot_product(q, k))
        return w[..., :4] @ v

    _raises_at_call(prog, r"indexing on the normalised weights is " + NOT_DSL)


def test_matmul_of_raw_q_and_k():
    def prog(q, k, v):
        return af.softmax(q @ k) @ v

    _raises_at_call(prog, r"@ on the query tensor q is " + NOT_DSL)


# --- parameters ----------------------------------------------------------------------------------------

GLOBAL_BIAS = torch.randn(1, 2, 8, 8)


def test_closure_tensor_as_runtime_parameter():
    def prog(q, k, v):
        return af.softmax(af.additive_bias(af.scaled_dot_product(q, k), GLOBAL_BIAS)) @ v

    _raises_at_call(
        prog,
        r"prog reads the global 'GLOBAL_BIAS', which holds a Tensor.*pass 'GLOBAL_BIAS' as an "
        r"argument of the program",
    )


def test_runtime_parameter_given_q():
    def prog(q, k, v):
        return af.softmax(af.additive_bias(af.scaled_dot_product(q, k), q)) @ v

    _raises_at_call(prog, r"additive_bias: parameter 'bias' is a runtime input.*got the query tensor q")


def test_static_parameter_given_a_symbol():
    def prog(q, k, v, left):
        return af.softmax(af.sliding_window(af.scaled_dot_product(q, k), left=left)) @ v

    program = af.attention(prog)
    with pytest.raises(ProgramError, match=r"sliding_window: parameter 'left' is static.*got the input 'left'"):
        program(*qkv(), torch.randn(1))


def test_combinator_called_outside_a_program():
    with pytest.raises(
        ProgramError,
        match=r"af\.causal must be called inside an @af\.attention function"
        r".*got a torch\.Tensor",
    ):
        af.causal(torch.randn(1, 2, 8, 8))


def test_score_source_called_outside_a_program():
    q, k, _ = qkv()
    with pytest.raises(
        ProgramError,
        match=r"af\.scaled_dot_product must be called inside an @af\.attention "
        r"function",
    ):
        af.scaled_dot_product(q, k)


BIND_CASES = [
    pytest.param(
        lambda s: af.sliding_window(s, left=2, window=3),
        r"sliding_window\(\) got an unknown parameter 'window'; allowed: left, right",
        id="unknown",
    ),
    pytest.param(
        lambda s: af.causal(s, 3), r"causal\(\) takes 0 parameter\(s\) after its inputs, got 1", id="too-many"
    ),
    pytest.param(lambda s: af.sliding_window(s), r"sliding_window\(\) is missing its parameter 'left'", id="missing"),
    pytest.param(
        lambda s: af.sliding_window(s, 2, left=2), r"sliding_window\(\) got parameter 'left' twice", id="twice"
    ),
]


def _mask_program(call):
    def prog(q, k, v):
        return af.softmax(call(af.scaled_dot_product(q, k))) @ v

    return prog


@pytest.mark.parametrize("call, match", BIND_CASES)
def test_parameter_binding_errors_name_the_combinator(call, match):
    """Unknown, surplus, missing or repeated parameters: a TypeError naming the combinator (today)."""
    _raises_at_call(_mask_program(call), match, exc=TypeError)


@pytest.mark.parametrize("call, match", BIND_CASES)
def test_parameter_binding_errors_are_program_errors(call, match):
    _raises_at_call(_mask_program(call), match)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda s: af.sliding_window(s, left=-1), r"sliding_window: parameter 'left': must be an int >= 0, got -1"),
        (lambda s: af.sliding_window(s, left=1.5), r"sliding_window: parameter 'left': must be an int >= 0, got 1\.5"),
        (lambda s: af.sliding_window(s, left=True), r"sliding_window: parameter 'left': must be an int >= 0, got True"),
        (
            lambda s: af.sliding_window(s, left=2, right=-3),
            r"sliding_window: parameter 'right': must be an int >= 0, got -3",
        ),
    ],
    ids=["left=-1", "left=1.5", "left=True", "right=-3"],
)
def test_bad_static_mask_values(call, match):
    def prog(q, k, v):
        return af.softmax(call(af.scaled_dot_product(q, k))) @ v

    _raises_at_call(prog, match)


@pytest.mark.parametrize("theta", [0, -1.0, float("inf"), "x"])
def test_bad_rope_theta(theta):
    def prog(q, k, v):
        return af.softmax(af.rope(q, k, theta=theta)) @ v

    _raises_at_call(prog, r"rope: parameter 'theta': must be a finite number > 0, got " + re.escape(repr(theta)))


@pytest.mark.parametrize("scale", ["x", float("nan"), True])
def test_bad_scale(scale):
    def prog(q, k, v):
        return af.softmax(af.scaled_dot_product(q, k, scale=scale)) @ v

    _raises_at_call(
        prog, r"scaled_dot_product: parameter 'scale': must be None or a finite number, got " + re.escape(repr(scale))
    )


def test_static_parameter_of_unsupported_type():
    def prog(q, k, v):
        return af.softmax(af.scaled_dot_product(q, k, scale=[0.5])) @ v

    _raises_at_call(prog, r"scaled_dot_product: parameter 'scale' must be None, bool, int, float or str, got list")


def test_trace_error_is_raised_again_on_every_call():
    """A failed trace is not cached as if it had succeeded."""

    def prog(q, k, v):
        return af.scaled_dot_product(q, k) @ v

    program = _raises_at_call(prog, r"no normaliser")
    with pytest.raises(ProgramError, match=r"no normaliser"):
        program(*qkv())
    with pytest.raises(ProgramError, match=r"no normaliser"):
        program.graph()


def test_program_error_is_a_type_error():
    assert issubclass(ProgramError, TypeError)
    assert issubclass(ProgramError, af.AttnFuseError)


# --- the decorated function's signature ----------------------------------------------------------------


def test_fewer_than_three_arguments():
    def prog(q, k):
        return af.softmax(af.scaled_dot_product(q, k))

    with pytest.raises(
        ProgramError,
        match=r"@af\.attention function prog must take q, k, v as its first three "
        r"arguments",
    ):
        af.attention(prog)


def test_star_args():
    def prog(q, k, v, *extra):
        return af.softmax(af.scaled_dot_product(q, k)) @ v

    with pytest.raises(ProgramError, match=r"prog must take q, k, v.*no \*args or \*\*kwargs"):
        af.attention(prog)


def test_star_star_kwargs():
    def prog(q, k, v, **extra):
        return af.softmax(af.scaled_dot_product(q, k)) @ v

    with pytest.raises(ProgramError, match=r"prog must take q, k, v.*no \*args or \*\*kwargs"):
        af.attention(prog)


def test_keyword_only_v():
    def prog(q, k, *, v):
        return af.softmax(af.scaled_dot_product(q, k)) @ v

    with pytest.raises(ProgramError, match=r"prog must take q, k, v as its first three arguments"):
        af.attention(prog)


@pytest.mark.parametrize("reserved", ["return_lse", "kv_lens", "block_table"])
def test_reserved_argument_name(reserved):
    ns: dict = {"af": af}
    exec(f"def prog(q, k, v, {reserved}=None):\n    return af.softmax(af.scaled_dot_product(q, k)) @ v", ns)
    with pytest.raises(ProgramError, match=rf"argument name\(s\) \['{reserved}'\] are reserved for the call"):
        af.attention(ns["prog"])


def test_return_lse_with_relu_attention():
    @af.attention
    def relu(q, k, v):
        return af.relu_attention(af.scaled_dot_product(q, k)) @ v

    with pytest.raises(
        InputError,
        match=r"return_lse=True needs a normaliser with a log-sum-exp; "
        r"relu_attention has none",
    ):
        relu(*qkv(), return_lse=True)
    with pytest.raises(InputError, match=r"return_lse=True needs a normaliser with a log-sum-exp"):
        relu.reference(*qkv(), return_lse=True)


@pytest.mark.parametrize("dtype", [None, torch.int32, torch.float8_e4m3fn, "float64"])
def test_reference_refuses_a_precision_it_cannot_compute_in(dtype):
    """None once meant "the inputs' dtype": a float64 reference computed in float16 without a word."""
    prog = af.attention(lambda q, k, v: af.softmax(af.scaled_dot_product(q, k)) @ v)
    with pytest.raises(InputError, match=r"dtype=.*: the reference evaluates in one of float64, float32, float16"):
        prog.reference(*qkv(), dtype=dtype)


def test_unknown_combinator_attribute():
    with pytest.raises(AttributeError, match=r"no combinator of that name is registered; `attnfuse list`"):
        af.no_such_combinator  # noqa: B018
    assert not hasattr(af, "flash_softmax_that_does_not_exist")


def test_dunder_attribute_is_a_plain_attribute_error():
    with pytest.raises(AttributeError):
        af.__no_such_dunder__  # noqa: B018


# --- tensor attributes and methods asked of a symbol ---------------------------------------------------


def _symbol_of(kind: str, q, k, v, bias):
    """The traced value of ``kind`` inside a program."""
    s = af.scaled_dot_product(q, k)
    w = af.softmax(s)
    return {"q": q, "k": k, "v": v, "input": bias, "scores": s, "weights": w, "output": w @ v}[kind]


SYMBOL_NAMES = {
    "q": "the query tensor q",
    "k": "the key tensor k",
    "v": "the value tensor v",
    "input": "the input 'bias'",
    "scores": "the scores",
    "weights": "the normalised weights",
    "output": "the attention output",
}


@pytest.mark.parametrize("kind", list(SYMBOL_NAMES))
@pytest.mark.parametrize(
    "name, use",
    [
        ("shape", lambda x: x.shape),
        ("dtype", lambda x: x.dtype),
        ("device", lambda x: x.device),
        ("size", lambda x: x.size(-1)),
        ("float", lambda x: x.float()),
        ("T", lambda x: x.T),
        ("softmax", lambda x: x.softmax(-1)),
        ("ndim", lambda x: x.ndim),
    ],
    ids=lambda p: p if isinstance(p, str) else "",
)
def test_tensor_attribute_of_a_symbol_names_it_and_what_is_allowed(kind, name, use):
    def prog(q, k, v, bias):
        use(_symbol_of(kind, q, k, v, bias))
        return af.softmax(af.scaled_dot_product(q, k)) @ v

    program = af.attention(prog)
    with pytest.raises(ProgramError) as info:
        program(*qkv(), torch.randn(1, 2, 8, 8))
    message = str(info.value)
    assert f"the attribute {name!r} of {SYMBOL_NAMES[kind]}" in message
    assert "may only apply combinators" in message and "ctx.D" in message and "extra argument" in message


def test_probing_a_symbol_still_answers():
    """getattr with a default, hasattr and copy see an AttributeError (protocols probe symbols)."""
    import copy

    seen = {}

    def prog(q, k, v):
        s = af.scaled_dot_product(q, k)
        seen["default"] = getattr(s, "shape", "absent")
        seen["has"] = hasattr(q, "dtype"), hasattr(s, "__array_interface__")
        copy.copy(s)
        return af.softmax(s) @ v

    plain = af.attention(lambda q, k, v: af.softmax(af.scaled_dot_product(q, k)) @ v)
    assert af.attention(prog).graph() == plain.graph()
    assert seen == {"default": "absent", "has": (False, False)}


# --- methods ------------------------------------------------------------------------------------------


class Model:
    window = 4

    def forward(self, q, k, v):
        return af.softmax(af.sliding_window(af.scaled_dot_product(q, k), self.window)) @ v

    def forward_with(self, q, k, v, bias):
        return af.softmax(af.additive_bias(af.scaled_dot_product(q, k), bias)) @ v

    @classmethod
    def forward_of_class(cls, q, k, v):
        return af.softmax(af.sliding_window(af.scaled_dot_product(q, k), cls.window)) @ v

    @af.attention
    def program_of_qkv(q, k, v):  # a plain function of q, k, v kept in a class: allowed  # noqa: N805
        return af.softmax(af.scaled_dot_product(q, k)) @ v


@pytest.mark.parametrize(
    "method, name, first",
    [
        (Model.forward, "Model.forward", "it takes 'self' first"),
        (Model.forward_with, "Model.forward_with", "it takes 'self' first"),
        (Model().forward, "Model.forward", "a bound method"),
        (Model.forward_of_class, "Model.forward_of_class", "a bound method"),
        (Model.forward_of_class.__func__, "Model.forward_of_class", "it takes 'cls' first"),
    ],
    ids=["function", "with an extra", "bound", "classmethod", "cls"],
)
def test_a_method_is_refused_at_decoration_saying_how_to_use_a_program_from_a_class(method, name, first):
    with pytest.raises(ProgramError) as info:
        af.attention(method)
    message = str(info.value)
    assert f"@af.attention function {name} is a method ({first})" in message
    assert "a program must be a plain function of (q, k, v, extra arguments)" in message
    assert "Define the program at module level and call it from the method" in message


def test_a_method_decorated_in_a_class_body_is_refused_there():
    with pytest.raises(ProgramError, match=r"function .*Layer\.attend is a method \(it takes 'self' first\)"):

        class Layer:
            @af.attention
            def attend(self, q, k, v):
                return af.softmax(af.scaled_dot_product(q, k)) @ v


def test_a_program_of_q_k_v_kept_in_a_class_is_reached_through_an_instance():
    plain = af.attention(lambda q, k, v: af.softmax(af.scaled_dot_product(q, k)) @ v)
    assert Model().program_of_qkv is Model.program_of_qkv
    assert Model().program_of_qkv.graph() == plain.graph()
