"""Values a program reads from outside its arguments are in its trace key, in every form it can read them.

Helpers reading module globals, class attributes (``Cfg.left``), module attributes (``cfgmod.SCALE``,
``pkg.mod.X``), chains of helpers, closures inside helpers: a changed value traces again and the result
matches an independent float64 attention computed with the new value; an unchanged value reuses the
trace. Reads the analysis cannot follow are a ProgramError.
"""
from __future__ import annotations

import importlib.util
import sys

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
    assert_matches_reference(program(q, k, v), attention(q, k, v, scale, left),
                             attention(q, k, v, scale, left, dtype=q.dtype))


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
    sub = make_module("attnfuse_test_pkg.sub", "import attnfuse as af\nX = 5\nLEFT = 1\n"
                      "def mask(s):\n    return af.sliding_window(s, LEFT)\n",
                      tmp_path / "attnfuse_test_pkg" / "sub.py")
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

    with pytest.raises(ProgramError, match=r"program imports 'attnfuse_test_inner' inside a function: .*import it "
                                           r"at module level"):
        af.attention(program)


def uses_the_class(s):
    return af.sliding_window(s, getattr(Cfg, "left"))


@pytest.mark.parametrize("body, match", [
    (lambda q, k, v: af.softmax(uses_the_class(af.scaled_dot_product(q, k))) @ v,
     r"reads the global 'Cfg' \(in uses_the_class\), the class itself: .*read its attributes by name"),
    (lambda q, k, v: af.softmax(af.sliding_window(af.scaled_dot_product(q, k), globals()["WINDOW"])) @ v,
     r"calls globals\(\): what it reads cannot be found"),
], ids=["a class as a value", "globals()"])
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
    with pytest.raises(ProgramError, match=r"reads the closure variable 'bias' \(in .*add_bias\), which holds a "
                                           r"Tensor.*pass 'bias' as an argument"):
        program(*(torch.randn(1, 2, N, D) for _ in range(3)))
