"""Values a program reads from outside its arguments are in its trace key, in every form it can read them.

Helpers reading module globals, class attributes (``Cfg.left``), module attributes (``cfgmod.SCALE``,
``pkg.mod.X``), chains of helpers, closures inside helpers: a changed value traces again and the result
matches an independent float64 attention computed with the new value; an unchanged value reuses the
trace. Reads the analysis cannot follow are a ProgramError.
"""

from __future__ import annotations

import datetime
import functools
import importlib.util
import math
import operator
import os
import random
import sys
import time
from os import getenv
from random import uniform

import pytest
import torch

import attnfuse as af
from attnfuse import ProgramError
from attnfuse.testing import assert_matches_reference

N, D = 32, 16
WINDOW = 4  # read by window_mask and, through it, by the helper chains below
SCALE = 0.5  # read by scaled_scores


def attention(q, k, v, scale, left=None, dtype=torch.float64):
    """Softmax attention written out in ``dtype``: s = q·kᵀ·scale, keys j in [i - left, i] when ``left``."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    s = q @ k.transpose(-1, -2) * scale
    if left is not None:
        i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
        s = s.masked_fill(~((j >= i - left) & (j <= i)), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def check(program, scale, left=None):
    """The program's output on fresh inputs matches the float64 attention for ``scale`` and ``left``."""
    q, k, v = (torch.randn(1, 2, N, D) for _ in range(3))
    assert_matches_reference(
        program(q, k, v), attention(q, k, v, scale, left), attention(q, k, v, scale, left, dtype=q.dtype)
    )


def window_mask(s):
    return af.sliding_window(s, WINDOW)


def scaled_scores(q, k):
    return af.scaled_dot_product(q, k, scale=SCALE)


def masked(s):
    return window_mask(s)  # a helper calling a helper


class Cfg:
    left = 3
    scale = 0.25


@af.attention
def helper_program(q, k, v):
    return af.softmax(window_mask(af.scaled_dot_product(q, k, scale=1.0))) @ v


def test_a_helper_reading_a_module_global(monkeypatch):
    check(helper_program, 1.0, WINDOW)
    graph = helper_program.graph()
    assert helper_program.graph() is graph  # unchanged: the same trace
    monkeypatch.setitem(globals(), "WINDOW", 9)
    assert helper_program.graph() is not graph
    check(helper_program, 1.0, 9)


@af.attention
def chained(q, k, v):
    return af.softmax(masked(scaled_scores(q, k))) @ v


def test_nested_helper_chains(monkeypatch):
    check(chained, SCALE, WINDOW)
    monkeypatch.setitem(globals(), "WINDOW", 11)
    check(chained, SCALE, 11)
    monkeypatch.setitem(globals(), "SCALE", 0.125)
    check(chained, 0.125, 11)


@af.attention
def class_attributes(q, k, v):
    s = af.scaled_dot_product(q, k, scale=Cfg.scale)
    return af.softmax(af.sliding_window(s, Cfg.left)) @ v


def test_class_attributes(monkeypatch):
    check(class_attributes, 0.25, 3)
    graph = class_attributes.graph()
    assert class_attributes.graph() is graph
    monkeypatch.setattr(Cfg, "left", 6)
    check(class_attributes, 0.25, 6)
    monkeypatch.setattr(Cfg, "scale", 0.75)
    check(class_attributes, 0.75, 6)


@pytest.fixture
def make_module(tmp_path, monkeypatch):
    """make_module(name, source): a real module from a file in tmp_path, imported, removed from
    sys.modules after the test."""

    def make(name: str, source: str, path=None):
        path = path or tmp_path / f"{name.replace('.', '_')}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)
        spec.loader.exec_module(module)
        return module

    return make


def test_module_attributes(make_module, monkeypatch):
    cfgmod = make_module("attnfuse_test_cfgmod", "SCALE = 0.5\nLEFT = 2\n")

    @af.attention
    def program(q, k, v):  # reads the module through a closure variable
        return af.softmax(af.sliding_window(af.scaled_dot_product(q, k, scale=cfgmod.SCALE), cfgmod.LEFT)) @ v

    check(program, 0.5, 2)
    graph = program.graph()
    assert program.graph() is graph
    monkeypatch.setattr(cfgmod, "SCALE", 2.0)
    check(program, 2.0, 2)
    monkeypatch.setattr(cfgmod, "LEFT", 7)
    check(program, 2.0, 7)


def test_attributes_of_a_package_submodule_and_its_helpers(make_module, tmp_path, monkeypatch):
    """pkg.sub.X through a package, and a helper of the submodule reading its own global."""
    (tmp_path / "attnfuse_test_pkg").mkdir()
    pkg = make_module("attnfuse_test_pkg", "", tmp_path / "attnfuse_test_pkg" / "__init__.py")
    sub = make_module(
        "attnfuse_test_pkg.sub",
        "import attnfuse as af\nX = 5\nLEFT = 1\ndef mask(s):\n    return af.sliding_window(s, LEFT)\n",
        tmp_path / "attnfuse_test_pkg" / "sub.py",
    )
    monkeypatch.setattr(pkg, "sub", sub, raising=False)

    @af.attention
    def program(q, k, v):
        s = af.scaled_dot_product(q, k, scale=1.0 / pkg.sub.X)
        return af.softmax(pkg.sub.mask(s)) @ v

    check(program, 0.2, 1)
    monkeypatch.setattr(sub, "X", 4)
    check(program, 0.25, 1)
    monkeypatch.setattr(sub, "LEFT", 8)
    check(program, 0.25, 8)


def test_a_user_module_named_like_a_standard_one(make_module, monkeypatch):
    """Only the standard library's own modules are taken as fixed, not a module of the user's named alike."""
    colorsys = make_module("colorsys", "LEFT = 2\n")

    @af.attention
    def program(q, k, v):
        return af.softmax(af.sliding_window(af.scaled_dot_product(q, k, scale=1.0), colorsys.LEFT)) @ v

    check(program, 1.0, 2)
    monkeypatch.setattr(colorsys, "LEFT", 5)
    check(program, 1.0, 5)


def make_window(cfg: dict):
    def mask(s):
        return af.sliding_window(s, cfg["left"])  # a closure cell of the helper

    return mask


CONFIG = {"left": 5}
closure_mask = make_window(CONFIG)


@af.attention
def helper_closure(q, k, v):
    return af.softmax(closure_mask(af.scaled_dot_product(q, k, scale=1.0))) @ v


def test_a_closure_inside_a_helper(monkeypatch):
    check(helper_closure, 1.0, 5)
    graph = helper_closure.graph()
    assert helper_closure.graph() is graph
    monkeypatch.setitem(CONFIG, "left", 2)
    check(helper_closure, 1.0, 2)


def test_a_rebound_helper_traces_again_and_its_reads_count(monkeypatch):
    """The new helper is analysed when the program is next called: what it reads is in the key too."""
    check(helper_closure, 1.0, CONFIG["left"])
    other = {"left": 1}
    monkeypatch.setitem(globals(), "closure_mask", make_window(other))
    check(helper_closure, 1.0, 1)
    other["left"] = 6
    check(helper_closure, 1.0, 6)


@af.attention
def reads_a_later_helper(q, k, v):
    return af.softmax(defined_after(af.scaled_dot_product(q, k, scale=1.0))) @ v


def defined_after(s):  # not defined yet when reads_a_later_helper was decorated
    return af.sliding_window(s, Cfg.left)


def test_a_helper_defined_after_the_program(monkeypatch):
    check(reads_a_later_helper, 1.0, Cfg.left)
    monkeypatch.setattr(Cfg, "left", 10)
    check(reads_a_later_helper, 1.0, 10)


def test_an_unchanged_value_reuses_the_trace():
    for program in (helper_program, chained, class_attributes, helper_closure):
        assert program.graph() is program.graph()
        q, k, v = (torch.randn(1, 2, N, D) for _ in range(3))
        program(q, k, v)
        assert program.graph() is program.graph()


NORMALISER = af.softmax


@af.attention
def chosen_normaliser(q, k, v):
    return NORMALISER(af.scaled_dot_product(q, k, scale=1.0)) @ v


def test_a_rebound_combinator_traces_again(monkeypatch):
    """Code read from outside counts by identity: a global naming another combinator is a new trace."""
    assert chosen_normaliser.graph().weights.apply.combinator == "softmax"
    monkeypatch.setitem(globals(), "NORMALISER", af.relu_attention)
    assert chosen_normaliser.graph().weights.apply.combinator == "relu_attention"


def test_a_program_reading_only_library_code_adds_no_reads():
    @af.attention
    def plain(q, k, v):
        return af.softmax(af.causal(af.scaled_dot_product(q, k, scale=torch.pi))) @ v

    assert plain._outside.empty


# Reads the analysis cannot follow: a ProgramError at decoration, naming what to do instead.


def test_a_user_module_imported_inside_a_function_is_refused(make_module):
    make_module("attnfuse_test_inner", "LEFT = 2\n")

    def program(q, k, v):
        import attnfuse_test_inner

        return af.softmax(af.sliding_window(af.scaled_dot_product(q, k), attnfuse_test_inner.LEFT)) @ v

    with pytest.raises(
        ProgramError,
        match=r"program imports 'attnfuse_test_inner' inside a function: .*import it "
        r"at module level",
    ):
        af.attention(program)


def uses_the_class(s):
    return af.sliding_window(s, getattr(Cfg, "left"))


@pytest.mark.parametrize(
    "body, match",
    [
        (
            lambda q, k, v: af.softmax(uses_the_class(af.scaled_dot_product(q, k))) @ v,
            r"reads the global 'Cfg' \(in uses_the_class\), the class itself: .*read its attributes by name",
        ),
        (
            lambda q, k, v: af.softmax(af.sliding_window(af.scaled_dot_product(q, k), globals()["WINDOW"])) @ v,
            r"calls globals\(\): what it reads cannot be found",
        ),
        (
            lambda q, k, v: (
                af.softmax(af.sliding_window(af.scaled_dot_product(q, k), int(__import__("os").environ["W"]))) @ v
            ),
            r"calls __import__\(\): what it reads cannot be found",
        ),
    ],
    ids=["a class as a value", "globals()", "__import__()"],
)
def test_reads_that_cannot_be_followed_are_refused(body, match):
    with pytest.raises(ProgramError, match=match):
        af.attention(body)


class Windows:
    left = 2

    @classmethod
    def mask(cls, s):
        return af.sliding_window(s, cls.left)


def test_a_bound_method_is_refused():
    with pytest.raises(ProgramError, match=r"reads the global 'Windows.mask', a bound method"):
        af.attention(lambda q, k, v: af.softmax(Windows.mask(af.scaled_dot_product(q, k))) @ v)


def test_an_object_read_through_a_helper_names_it():
    bias = torch.randn(1, 2, N, N)

    def add_bias(s):
        return af.additive_bias(s, bias)

    program = af.attention(lambda q, k, v: af.softmax(add_bias(af.scaled_dot_product(q, k))) @ v)
    with pytest.raises(
        ProgramError,
        match=r"reads the closure variable 'bias' \(in .*add_bias\), which holds a "
        r"Tensor.*pass 'bias' as an argument",
    ):
        program(*(torch.randn(1, 2, N, D) for _ in range(3)))


# Standard-library state: the environment, the clock, random numbers, sys.argv. No key can follow what a call
# (os.getenv(), time.time()) returns, so every read of such a module, of its code or of its objects is refused
# at decoration, naming the read; pure modules (math, operator, functools ...) stay fixed code.


def _window_from_environment():
    return int(os.environ.get("ATTNFUSE_TEST_WINDOW", "2"))


STATE_READS = {
    "os.environ.get": lambda q, k, v: (
        af.softmax(af.sliding_window(af.scaled_dot_product(q, k), int(os.environ.get("ATTNFUSE_TEST_WINDOW", "2")))) @ v
    ),
    "os.environ[]": lambda q, k, v: (
        af.softmax(af.sliding_window(af.scaled_dot_product(q, k), int(os.environ["ATTNFUSE_TEST_WINDOW"]))) @ v
    ),
    "os.getenv": lambda q, k, v: (
        af.softmax(af.sliding_window(af.scaled_dot_product(q, k), int(os.getenv("ATTNFUSE_TEST_WINDOW", "2")))) @ v
    ),
    "getenv": lambda q, k, v: (
        af.softmax(af.sliding_window(af.scaled_dot_product(q, k), int(getenv("ATTNFUSE_TEST_WINDOW", "2")))) @ v
    ),
    "environ.get": lambda q, k, v: (
        af.softmax(af.sliding_window(af.scaled_dot_product(q, k), int(get_environment("ATTNFUSE_TEST_WINDOW", "2"))))
        @ v
    ),
    "a helper": lambda q, k, v: (
        af.softmax(af.sliding_window(af.scaled_dot_product(q, k), _window_from_environment())) @ v
    ),
    "time.time": lambda q, k, v: af.softmax(af.sliding_window(af.scaled_dot_product(q, k), int(time.time()) % 5)) @ v,
    "random.random": lambda q, k, v: af.softmax(af.scaled_dot_product(q, k, scale=random.random() + 0.5)) @ v,
    "random (a bound method)": lambda q, k, v: af.softmax(af.scaled_dot_product(q, k, scale=uniform(0.5, 1))) @ v,
    "sys.argv": lambda q, k, v: af.softmax(af.sliding_window(af.scaled_dot_product(q, k), len(sys.argv))) @ v,
    "datetime": lambda q, k, v: (
        af.softmax(af.sliding_window(af.scaled_dot_product(q, k), datetime.datetime.now().second % 5)) @ v
    ),
    "os.path": lambda q, k, v: (
        af.softmax(af.sliding_window(af.scaled_dot_product(q, k), len(os.path.expanduser("~")))) @ v
    ),
}
STATE_READ_LABELS = {
    "os.environ.get": "the global 'os.environ.get', standard-library state of os",
    "os.environ[]": "the global 'os.environ', standard-library state of os",
    "os.getenv": "the global 'os.getenv', standard-library state of os",
    "getenv": "the global 'getenv', standard-library state of os",
    "environ.get": "the global 'get_environment', standard-library state of os",
    "a helper": r"the global 'os.environ.get' \(in _window_from_environment\), standard-library state of os",
    "time.time": "the global 'time.time', standard-library state of time",
    "random.random": "the global 'random.random', standard-library state of random",
    "random (a bound method)": "the global 'uniform', standard-library state of random",
    "sys.argv": "the global 'sys.argv', standard-library state of sys",
    "datetime": "the global 'datetime.datetime.now', standard-library state of datetime",
    "os.path": "the global 'os.path.expanduser', standard-library state of os",
}
get_environment = os.environ.get


@pytest.mark.parametrize("read", sorted(STATE_READS))
def test_standard_library_state_is_refused_naming_the_read(read, monkeypatch):
    """The class: reads of the environment, the clock, random numbers and sys.argv, through the module, a
    name imported from it, a bound method of its objects or a helper; never a stale trace."""
    monkeypatch.setenv("ATTNFUSE_TEST_WINDOW", "2")
    with pytest.raises(
        ProgramError,
        match=rf"reads {STATE_READ_LABELS[read]} .*can change between calls.*pass the "
        rf"value as an argument",
    ):
        af.attention(STATE_READS[read])


def test_a_standard_library_module_imported_inside_a_function_is_refused():
    def program(q, k, v):
        import os as inner_os

        return af.softmax(af.sliding_window(af.scaled_dot_product(q, k), int(inner_os.environ["W"]))) @ v

    with pytest.raises(
        ProgramError,
        match=r"program imports 'os' inside a function, standard-library state .*pass "
        r"the value as an argument",
    ):
        af.attention(program)


@pytest.mark.parametrize("builtin", ["open", "input"])
def test_builtins_reading_outside_state_are_refused(builtin):
    body = {
        "open": lambda q, k, v: af.softmax(af.scaled_dot_product(q, k, scale=float(open("s").read()))) @ v,
        "input": lambda q, k, v: af.softmax(af.scaled_dot_product(q, k, scale=float(input()))) @ v,
    }[builtin]
    with pytest.raises(ProgramError, match=rf"calls {builtin}\(\): .*can change between calls"):
        af.attention(body)


@af.attention
def switched(q, k, v):
    return (
        af.softmax(
            af.sliding_window(af.scaled_dot_product(q, k, scale=1.0), int(WINDOW_SOURCE("ATTNFUSE_TEST_WINDOW", "2")))
        )
        @ v
    )


def WINDOW_SOURCE(name, default):
    return "3"


def test_a_global_rebound_to_standard_library_state_is_refused_at_the_call(monkeypatch):
    """A helper rebound after decoration to os.getenv: the next call refuses it (no trace of the old value)."""
    check(switched, 1.0, 3)
    monkeypatch.setitem(globals(), "WINDOW_SOURCE", os.getenv)
    monkeypatch.setenv("ATTNFUSE_TEST_WINDOW", "5")
    with pytest.raises(ProgramError, match=r"reads the global 'WINDOW_SOURCE', standard-library state of os"):
        switched(*(torch.randn(1, 2, N, D) for _ in range(3)))


def test_pure_standard_library_modules_are_fixed_code():
    """math, operator, functools: read as fixed code, no read per call."""

    @af.attention
    def pure(q, k, v):
        scale = functools.reduce(operator.mul, (math.sqrt(0.25), math.pi / math.pi))
        return af.softmax(af.scaled_dot_product(q, k, scale=scale)) @ v

    assert pure._outside.empty
    check(pure, 0.5)
