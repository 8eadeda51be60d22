"""Tests of attnfuse-legacy-demo: the checks its author wrote on 2026-11-30 (conformance fuzzing, fixed programs
against the float64 reference), then what AttnFuse promises while the old contract is deprecated."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
import zlib

import pytest

try:
    importlib.metadata.distribution("attnfuse-legacy-demo")
except importlib.metadata.PackageNotFoundError:
    pytest.skip(
        "attnfuse-legacy-demo is not installed (.ci/run installs it: "
        "pip install -e tests/legacy_plugin/attnfuse-legacy-demo)",
        allow_module_level=True,
    )

import torch

import attnfuse as af
from attnfuse.testing import assert_matches_reference, check_combinator

FUZZ_EXAMPLES = int(os.environ.get("ATTNFUSE_FUZZ_EXAMPLES", "4"))
NAMES = ("legacy_head_scale", "legacy_causal_radius", "legacy_softmax1")
CASES = [pytest.param("cpu", dtype, id=f"cpu-{str(dtype)[6:]}") for dtype in (torch.float32, torch.float16)]
if torch.cuda.is_available():
    CASES += [
        pytest.param("cuda", dtype, id=f"cuda-{str(dtype)[6:]}")
        for dtype in (torch.float32, torch.float16, torch.bfloat16)
    ]


def test_registered_by_this_distribution():
    for name in NAMES:
        entry = af.combinators()[name]
        assert entry.distribution == "attnfuse-legacy-demo"
        assert callable(getattr(af, name))


@pytest.mark.parametrize("name", ["legacy_head_scale", "legacy_softmax1"])
def test_conforms(name):
    check_combinator(name, max_examples=FUZZ_EXAMPLES)


@af.attention
def all_three(q, k, v, weights):
    s = af.legacy_head_scale(af.scaled_dot_product(q, k), weights)
    return af.legacy_softmax1(af.legacy_causal_radius(s, 5.5)) @ v


@af.attention
def radius_only(q, k, v):
    return af.softmax(af.legacy_causal_radius(af.scaled_dot_product(q, k), 3)) @ v


def inputs(shape, dtype, device):
    B, Hq, Hkv, Nq, Nk, D = shape
    g = torch.Generator().manual_seed(zlib.crc32(repr((shape, dtype)).encode()))
    q = torch.randn(B, Hq, Nq, D, generator=g).to(dtype).to(device)
    k = torch.randn(B, Hkv, Nk, D, generator=g).to(dtype).to(device)
    v = torch.randn(B, Hkv, Nk, D, generator=g).to(dtype).to(device)
    return q, k, v, torch.randn(Hq, generator=g).to(device)


@pytest.mark.parametrize("device, dtype", CASES)
@pytest.mark.parametrize(
    "shape", [(2, 4, 2, 37, 53, 32), (1, 2, 1, 64, 64, 16)], ids=lambda s: "B{}_Hq{}_Hkv{}_Nq{}_Nk{}_D{}".format(*s)
)
def test_fixed_program_matches_reference(device, dtype, shape):
    q, k, v, w = inputs(shape, dtype, device)
    out, lse = all_three(q, k, v, w, return_lse=True)
    ref64 = all_three.reference(q, k, v, w, return_lse=True, dtype=torch.float64)
    ref_lowp = all_three.reference(q, k, v, w, return_lse=True, dtype=dtype)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_matches_reference(out, ref64[0], ref_lowp[0], dtype, what="out")
    assert_matches_reference(lse, ref64[1], ref_lowp[1], dtype, what="lse")


def test_gradients_match_reference():
    q, k, v, w = inputs((1, 2, 1, 29, 41, 16), torch.float32, "cpu")
    for t in (q, k, v):
        t.requires_grad_(True)
    out = all_three(q, k, v, w)
    ref = all_three.reference(q, k, v, w, dtype=torch.float64)
    ref32 = all_three.reference(q, k, v, w, dtype=torch.float32)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout.double())
    want32 = torch.autograd.grad(ref32, (q, k, v), dout)
    for name, a, b, c in zip(("dq", "dk", "dv"), got, want, want32):
        assert_matches_reference(a, b, c, torch.float32, what=name)


def test_decoding_from_a_cache_matches_reference():
    q, k, v, _ = inputs((2, 4, 2, 3, 70, 32), torch.float32, "cpu")
    kv_lens = torch.tensor([70, 12], dtype=torch.int32)
    out = radius_only(q, k, v, kv_lens=kv_lens)
    ref64 = radius_only.reference(q, k, v, kv_lens=kv_lens, dtype=torch.float64)
    ref32 = radius_only.reference(q, k, v, kv_lens=kv_lens, dtype=torch.float32)
    assert_matches_reference(out, ref64, ref32, torch.float32)


# --- Added with the deprecation (2026-12-03): what AttnFuse promises for this package's old forms ---------

WARNINGS = textwrap.dedent("""
    import attnfuse as af
    from attnfuse.plugin_manager import register_plugin, unregister_plugin

    af.combinators()
    register_plugin(object(), name="another")   # collecting the registry again (lints again) warns no more
    unregister_plugin("another")
    af.combinators()
""")


def test_each_old_form_warns_once_naming_the_combinator_field_and_fix():
    env = {k: v for k, v in os.environ.items() if k != "ATTNFUSE_DISABLE_PLUGIN_AUTOLOAD"}
    done = subprocess.run(
        [sys.executable, "-W", "always::DeprecationWarning", "-c", WARNINGS],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    warned = [line for line in done.stderr.splitlines() if "DeprecationWarning" in line]
    fields = {"legacy_head_scale": "prologue", "legacy_causal_radius": "keep", "legacy_softmax1": "init"}
    for name, field in fields.items():
        [line] = [w for w in warned if f"combinator {name!r}" in w and "tl.float32" in w]
        assert f"combinator {name!r} of distribution 'attnfuse-legacy-demo', fragment field {field!r}" in line
        assert "write $acc_dtype" in line and "float64" in line
    [line] = [w for w in warned if "examples" in w]
    assert "combinator 'legacy_causal_radius'" in line and "declare examples(draw, shape)" in line
    assert len(warned) == 4, warned


def scaled(q, k, v, w):
    return af.softmax(af.legacy_head_scale(af.scaled_dot_product(q, k), w)) @ v


def within(q, k, v, w):
    return af.softmax(af.legacy_causal_radius(af.scaled_dot_product(q, k), 2.0)) @ v


def softmax1(q, k, v, w):
    return af.legacy_softmax1(af.scaled_dot_product(q, k)) @ v


@pytest.mark.parametrize(
    "name, field, program",
    [
        ("legacy_head_scale", "prologue", scaled),
        ("legacy_causal_radius", "keep", within),
        ("legacy_softmax1", "init", softmax1),
    ],
)
def test_float64_call_is_refused_naming_combinator_and_field(name, field, program):
    prog = af.attention(program)
    q, k, v, w = inputs((1, 2, 1, 8, 8, 16), torch.float64, "cpu")
    with pytest.raises(
        (af.InputError, af.ProgramError),
        match=rf"combinator '{name}' of distribution 'attnfuse-legacy-demo', fragment field "
        rf"'{field}'.* tl\.float32 .*float64",
    ):
        prog(q, k, v, w)
    ref = prog.reference(q, k, v, w, dtype=torch.float64)  # the reference still runs in float64
    assert ref.dtype == torch.float64 and torch.isfinite(ref).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float8_e4m3fn"])
def test_its_tile_hooks_still_choose_whatever_the_dtype(dtype):
    """Tile rules and the tile hook gained a dtype (2026-12-05): a hook that does not name it and a rule without
    it still decide, for every dtype, and only where they match."""
    from attnfuse.passes.tile import choose_tiles
    from attnfuse_legacy_demo.tiles import CHOSEN, RULED

    assert choose_tiles("sm80", "masked", 128, "forward", dtype) == RULED
    assert choose_tiles("sm80", "masked", 64, "dq", dtype) == CHOSEN
    assert choose_tiles("sm80", "dense", 128, "forward", dtype) not in (RULED, CHOSEN)
