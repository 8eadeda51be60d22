"""What a plugin author reads when the conformance kit fails: each mask-fact violation once; a wrong value as
its shape, worst element (index, actual, expected, tolerance) and the replay line, never whole tensors or
pytest's own frames; no RuntimeWarning from Triton's interpreter. The kit runs on planted bugs, in pytest
subprocesses on a throwaway project as a plugin author's would, and in this process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import attnfuse as af
from attnfuse.testing.mask_facts import MaskFactError, check_mask_facts
from attnfuse.testing.planted_bugs import planted

# Under -n one worker runs this module's fixtures once: conftest.ONE_WORKER_MODULES

# The planted bugs, plus a bias whose body is wrong unless the head dim is 32: the kit's fixed cases (D=32) pass,
# so only the fuzzer (Hypothesis) finds it, with a runtime tensor among the drawn inputs.
CONFTEST = textwrap.dedent("""
    import attrs
    import attnfuse as af
    from attnfuse.plugin_manager import lookup
    from attnfuse.testing.planted_bugs import planted

    bias = lookup("additive_bias")
    FUZZ_ONLY = attrs.evolve(bias, name="_kit_fuzz_only", fragment=attrs.evolve(
        bias.fragment, body=bias.fragment.body.replace("s = s +", "s = s + (D != 32) * 0.5 +")))


    class Plugin:
        @af.hookimpl
        def attnfuse_combinators(self):
            return [planted("full_range_off_by_one"), planted("wrong_backward"), FUZZ_ONLY]


    af.register_plugin(Plugin(), name="kit-output")
""")

TESTS = textwrap.dedent("""
    import attnfuse as af


    def test_fact(attnfuse_conformance):
        attnfuse_conformance("_planted_full_range_off_by_one")


    def test_backward(attnfuse_conformance):
        attnfuse_conformance("_planted_wrong_backward", max_examples=1, seed=7)


    def test_fuzz(attnfuse_conformance):
        attnfuse_conformance("_kit_fuzz_only", max_examples=4, seed=3)


    def test_quiet():  # a passing fixed program whose second sequence keeps no block: its lse is log(0)
        import torch
        from attnfuse.testing import assert_matches_reference

        q, k, v = (torch.randn(2, 2, n, 16) for n in (13, 32, 32))
        mask = af.create_block_mask_from_blocks(lambda b, h, qb, kb: (b == 0) & (qb >= 0), 2, None, 13, 32,
                                                block_size=16)
        out, lse = SPARSE(q, k, v, mask, return_lse=True)
        ref64, ref32 = (SPARSE.reference(q, k, v, mask, return_lse=True, dtype=d)
                        for d in (torch.float64, torch.float32))
        assert_matches_reference(out, ref64[0], ref32[0], torch.float32)
        assert_matches_reference(lse, ref64[1], ref32[1], torch.float32)


    @af.attention
    def SPARSE(q, k, v, block_mask):
        return af.softmax(af.block_sparse(af.scaled_dot_product(q, k), block_mask)) @ v
""")


def pytest_in(root: Path, *args: str) -> subprocess.CompletedProcess:
    """pytest in ``root`` as a plugin author runs it, with the built-ins and the planted plugins only: other
    installed plugins' warnings (the frozen old-style package's deprecations) are not the kit's output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["ATTNFUSE_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "default", *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("kit-output")
    (root / "conftest.py").write_text(CONFTEST)
    (root / "test_planted.py").write_text(TESTS)
    return root


@pytest.fixture(scope="module")
def failures(project) -> dict[str, str]:
    """Each failing test's section of the pytest report, by test name, and the whole output as "all"."""
    done = pytest_in(project)
    assert done.returncode == 1 and "3 failed, 1 passed" in done.stdout, done.stdout + done.stderr
    # pytest's closing summary repeats each message, untruncated where $CI is set: not part of a section
    report = done.stdout.split(" short test summary info ")[0]
    sections = report.split("_ test_")
    found = {name: next(s for s in sections if s.startswith(f"{name} _")) for name in ("fact", "backward", "fuzz")}
    return {**found, "all": done.stdout + done.stderr}


def test_each_mask_fact_violation_is_printed_once(failures):
    lines = [line for line in failures["fact"].splitlines() if "combinator '_planted_full_range_off_by_one': " in line]
    assert len(lines) >= 10
    assert len(set(lines)) == len(lines), "a violation is printed more than once"
    assert sum("query block of positions 51..63 (rows 0..12, b=0, h=0)" in line for line in lines) == 1


def test_mask_fact_error_lists_distinct_violations():
    comb = planted("full_range_off_by_one")

    class Plugin:
        @af.hookimpl
        def attnfuse_combinators(self):
            return [comb]

    af.register_plugin(Plugin(), name="test-kit-output-facts")
    try:
        with pytest.raises(MaskFactError) as info:
            check_mask_facts(comb.name)
    finally:
        af.unregister_plugin("test-kit-output-facts")
    lines = str(info.value).splitlines()[1:]
    assert len(lines) == 20 and len(set(lines)) == 20


@pytest.mark.parametrize(
    "test, shape, name",
    [
        ("backward", "dq of _planted_wrong_backward(", "_planted_wrong_backward"),
        ("fuzz", "_kit_fuzz_only(", "_kit_fuzz_only"),
    ],
)
def test_a_wrong_value_shows_shape_worst_element_and_replay_not_tensors(failures, test, shape, name):
    text = failures[test]
    assert len(text) < 5000, text
    assert "tensor(" not in text and "tensor([" not in text
    assert shape in text and ": shape (" in text
    assert "element(s) beyond the tolerance, the worst at index (" in text
    assert ": actual " in text and ", expected " in text and "(float64 reference), error " in text
    assert " > tolerance " in text
    assert f"replay: check_combinator('{name}'," in text


def test_fuzzer_draws_print_runtime_inputs_as_shapes(failures):
    text = failures["fuzz"]
    assert "Draw 2 (program): ProgramCase(" in text
    assert "extras={_kit_fuzz_only_1_bias: (" in text


def test_no_runtime_warning_reaches_the_output(failures):
    assert "RuntimeWarning" not in failures["all"] and "divide by zero" not in failures["all"]


def test_option_failures_are_their_messages(project):
    done = pytest_in(
        project,
        "--attnfuse-conformance=_planted_wrong_backward,_planted_full_range_off_by_one",
        "--attnfuse-examples=1",
        "-k",
        "attnfuse-conformance",
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "_pytest" not in done.stdout and "pluggy" not in done.stdout
    assert len(done.stdout) < 12000, done.stdout
    assert "\nAssertionError: dq of _planted_wrong_backward(" in done.stdout
    assert "\nreplay: check_combinator('_planted_wrong_backward'," in done.stdout
    assert "\nattnfuse.testing.mask_facts.MaskFactError: mask '_planted_full_range_off_by_one'" in done.stdout


def test_interpreted_launch_raises_no_floating_point_warning():
    """A sequence that keeps no block: its rows' lse is log(0) = -inf, as on a GPU, with no numpy warning."""

    @af.attention
    def program(q, k, v, block_mask):
        return af.softmax(af.block_sparse(af.scaled_dot_product(q, k), block_mask)) @ v

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 16, generator=g) for n in (13, 32, 32))
    mask = af.create_block_mask_from_blocks(lambda b, h, qb, kb: (b == 0) & (qb >= 0), 2, None, 13, 32, block_size=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, lse = program(q, k, v, mask, return_lse=True)
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == []
    ref, ref_lse = program.reference(q, k, v, mask, return_lse=True, dtype=torch.float64)
    assert torch.isneginf(lse[1]).all() and torch.isneginf(ref_lse[1]).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_interpreted_launch_raises_no_warning_on_nan_rows():
    """Query rows of NaN make every score of their rows NaN: the interpreter's all-NaN row maxima warn nothing,
    as a GPU raises none, and the output equals the float64 reference's, NaN where the reference has NaN."""

    @af.attention
    def program(q, k, v):
        return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=g) for _ in range(3))
    q[:, :, :32] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = program(q, k, v)
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == []
    torch.testing.assert_close(out.double(), program.reference(q, k, v), equal_nan=True, atol=1e-5, rtol=1e-5)
