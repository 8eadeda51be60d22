"""Tiles chosen by plugins: the ``attnfuse_tile_config`` hook (pluggy's firstresult: the first plugin that
answers decides) comes before the rules of ``attnfuse_tile_configs``, which come before the built-in table;
the kernels run with the tiles chosen and still match the reference."""

import attrs
import pytest
import torch

import attnfuse as af
from attnfuse import PluginError
from attnfuse.hookspecs import hookimpl
from attnfuse.passes.tile import (
    FLOAT32_FMA_GATE,
    FLOAT32_FMA_TILES,
    FLOAT32_REGISTER_CAP,
    FMA_TILED_KERNELS,
    TileRule,
    choose_tiles,
    float32_fma_tiles,
)
from attnfuse.plan import TileConfig
from attnfuse.runtime.inputs import MAX_HEAD_DIM
from attnfuse.runtime.launch import clear_cache
from attnfuse.testing import assert_matches_reference

from conftest import last_call

CHOSEN = TileConfig(block_m=16, block_n=64, num_warps=1, num_stages=1)
RULED = TileConfig(block_m=64, block_n=16, num_warps=1, num_stages=1)


@af.attention
def causal(q, k, v):
    return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v


class Chooser:
    """Chooses the forward's tiles on the interpreter; takes only the arguments it reads."""

    def __init__(self, tiles):
        self.tiles = tiles

    @hookimpl
    def attnfuse_tile_config(self, kernel, arch):
        return self.tiles if (kernel, arch) == ("forward", "interpreter") else None


class Rules:
    @hookimpl
    def attnfuse_tile_configs(self):
        return [TileRule(arch="interpreter", kernel="forward", config=RULED)]


@pytest.fixture
def registered():
    names = []

    def register(plugin):
        names.append(f"test-tiles-{len(names)}")
        af.register_plugin(plugin, name=names[-1])
        clear_cache()

    yield register
    for name in names:
        af.unregister_plugin(name)
    clear_cache()


def test_the_first_answer_decides_before_the_rules_and_the_table(registered):
    table = choose_tiles("interpreter", "masked", 32, "forward", "float32")
    registered(Rules())
    assert choose_tiles("interpreter", "masked", 32, "forward", "float32") == RULED
    registered(Chooser(None))  # declines: the rules decide
    assert choose_tiles("interpreter", "masked", 32, "forward", "float32") == RULED
    registered(Chooser(CHOSEN))
    assert choose_tiles("interpreter", "masked", 32, "forward", "float32") == CHOSEN
    assert choose_tiles("interpreter", "masked", 32, "dq", "float32") == table  # no plugin chooses: the table


def test_a_program_runs_with_the_tiles_chosen(registered):
    q, k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    registered(Chooser(CHOSEN))
    out = causal(q, k, v)
    assert last_call().forward.kernel.tiles == CHOSEN
    assert_matches_reference(
        out, causal.reference(q, k, v), causal.reference(q, k, v, dtype=torch.float32), torch.float32
    )


def test_an_answer_that_is_not_tiles_is_a_plugin_error(registered):
    registered(Chooser((16, 16)))
    with pytest.raises(PluginError, match=r"chose \(16, 16\) as the tiles of the forward kernel"):
        choose_tiles("interpreter", "masked", 32, "forward", "float32")


def test_rules_and_the_hook_see_the_dtype(registered):
    """A float8 rule covers both float8 types and nothing else; a hook that names ``dtype`` receives it, and
    ``matches`` called without one (the 0.x signature) matches only rules for any dtype."""
    rule = TileRule(arch="interpreter", dtype="float8", config=RULED)
    assert rule.matches("forward", "interpreter", "dense", 32, "float8_e4m3fn")
    assert rule.matches("forward", "interpreter", "dense", 32, "float8_e5m2")
    assert not rule.matches("forward", "interpreter", "dense", 32, "bfloat16")
    assert not rule.matches("forward", "interpreter", "dense", 32)
    assert TileRule(config=RULED).matches("forward", "interpreter", "dense", 32)
    seen = []

    class Recorder:
        @hookimpl
        def attnfuse_tile_config(self, dtype):
            seen.append(dtype)

    registered(Recorder())
    choose_tiles("interpreter", "masked", 32, "forward", "float16")
    assert seen == ["float16"]


def test_the_table_gives_float8_forwards_their_own_tiles():
    """Swept on an H100 (sweep_tiles.py --fp8): 128 x 64 at D 128, where bfloat16's 128 x 128 spills."""
    fp8 = choose_tiles("sm90", "masked", 128, "forward", "float8_e5m2")
    assert (fp8.block_m, fp8.block_n, fp8.num_warps) == (128, 64, 8)
    assert choose_tiles("sm90", "masked", 128, "forward", "bfloat16").block_n == 128
    assert choose_tiles("sm90", "masked", 128, "dq", "float8_e4m3fn") == choose_tiles(
        "sm90", "masked", 128, "dq", "bfloat16"
    )


def test_float32_kernels_on_a_gpu_cap_registers_unless_the_tiles_name_a_cap(registered):
    assert choose_tiles("sm90", "masked", 64, "dkdv", "float32").max_registers == 255
    assert choose_tiles("sm90", "masked", 64, "dkdv", "bfloat16").max_registers is None
    assert choose_tiles("interpreter", "masked", 64, "dkdv", "float32").max_registers is None

    class Capped:
        @hookimpl
        def attnfuse_tile_configs(self):
            return [TileRule(arch="sm90", config=TileConfig(block_m=32, block_n=32, max_registers=128))]

    registered(Capped())
    assert choose_tiles("sm90", "masked", 64, "dkdv", "float32").max_registers == 128
    with pytest.raises(ValueError, match="max_registers"):
        TileConfig(block_m=32, block_n=32, max_registers=256)


def test_ieee_float32_kernels_on_a_gpu_take_fma_tiles_unless_a_plugin_chooses(registered, monkeypatch):
    """IEEE float32 dots run on the FMA units, where the table's tensor-core tiles spill; TF32 dots (allowed by
    torch.backends.cuda.matmul.allow_tf32) run on tensor cores and keep the table's tiles. A GPU takes the FMA tiles
    by default only where a GPU run has checked them, elsewhere only when its environment variable asks."""
    monkeypatch.delenv(FLOAT32_FMA_GATE.env, raising=False)
    unchecked = next(arch for arch in ("sm90", "sm80", "sm100") if arch not in FLOAT32_FMA_GATE.checked)
    table = attrs.evolve(choose_tiles(unchecked, "masked", 128, "forward", "bfloat16"), max_registers=255)
    assert choose_tiles(unchecked, "masked", 128, "forward", "float32") == table
    monkeypatch.setenv(FLOAT32_FMA_GATE.env, "1")
    for kernel in FMA_TILED_KERNELS:
        assert choose_tiles("sm90", "masked", 128, kernel, "float32") == float32_fma_tiles(kernel, 128)
        assert choose_tiles("sm80", "listed", 256, kernel, "float32", "ieee") == float32_fma_tiles(kernel, 256)
        tf32 = choose_tiles("sm90", "masked", 128, kernel, "float32", "tf32")
        assert tf32 == attrs.evolve(choose_tiles("sm90", "masked", 128, kernel, "bfloat16"), max_registers=255)
    decode = attrs.evolve(choose_tiles("sm90", "masked", 128, "decode", "bfloat16"), max_registers=255)
    assert choose_tiles("sm90", "masked", 128, "decode", "float32") == decode
    assert choose_tiles("interpreter", "masked", 64, "dkdv", "float32").num_warps == 1

    class Chooses:
        @hookimpl
        def attnfuse_tile_configs(self):
            return [TileRule(arch="sm90", kernel="dq", config=TileConfig(block_m=64, block_n=16))]

    registered(Chooses())
    assert choose_tiles("sm90", "masked", 128, "dq", "float32") == TileConfig(
        block_m=64, block_n=16, max_registers=FLOAT32_REGISTER_CAP
    )
    assert choose_tiles("sm90", "masked", 128, "dkdv", "float32") == float32_fma_tiles("dkdv", 128)


@pytest.mark.parametrize("kernel", FMA_TILED_KERNELS)
def test_float32_fma_tiles_follow_the_head_dim(kernel):
    """Each head dim a call takes (1 to ``MAX_HEAD_DIM``) has a row of ``FLOAT32_FMA_TILES``: the first that covers
    it, capped."""
    rows = [(largest, tiles[kernel]) for largest, tiles in FLOAT32_FMA_TILES]
    assert rows[-1][0] == MAX_HEAD_DIM
    smallest = 1
    for largest, tiles in rows:
        for head_dim in (smallest, largest):
            assert float32_fma_tiles(kernel, head_dim) == tiles
        assert tiles.max_registers == FLOAT32_REGISTER_CAP
        smallest = largest + 1


def test_a_tile_config_reads_as_it_did_before_the_register_cap():
    """Template instances' digests hash their tiles' text, and the GPU record names instances by those digests."""
    assert repr(TileConfig(block_m=64, block_n=32, num_stages=3)) == (
        "TileConfig(block_m=64, block_n=32, num_warps=4, num_stages=3)"
    )
    assert repr(TileConfig(block_m=64, block_n=32, max_registers=200)).endswith(", max_registers=200)")
