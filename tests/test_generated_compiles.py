"""The generated kernels compile for an H100/H200 (sm_90a, no GPU needed) at each dtype a GPU runs them in.

The CPU tests run these kernels through Triton's interpreter, which never lowers them: a kernel the interpreter
runs can still fail in Triton's GPU passes. A float32 block-sparse program did (its partial-block `if`, yielding
a boolean tile after a load, failed in ConvertTritonGPUToLLVM on an H100), so such programs compile here, every
kind, at each dtype. Beside them, two things of the generated code a GPU found that a CPU can check: the dK/dV
loops never divide by 0, and float32 kernels get the registers they need and tiles that fit in them."""

from __future__ import annotations

import inspect
import re

import attrs
import pytest

import attnfuse as af
from attnfuse.cli.show import RuntimePlaceholder
from attnfuse.kernels.generated_resources import generated_resources
from attnfuse.kernels.tiles import SHARED_MEMORY_LIMIT
from attnfuse.passes.tile import FLOAT32_FMA_GATE, FLOAT32_REGISTER_CAP, float32_fma_tiles
from attnfuse.plan import KernelConfig, TileConfig
from attnfuse.runtime.compiled import compiled
from attnfuse.runtime.source_cache import CACHE_ENV


@af.attention
def block_sparse(q, k, v, block_mask):
    return af.softmax(af.block_sparse(af.scaled_dot_product(q, k, scale=0.3), block_mask)) @ v


@af.attention
def composed(q, k, v, bias, block_mask):  # the GPU conformance run's failing program, less its qk transforms
    s = af.alibi(af.additive_bias(af.scaled_dot_product(q, k), bias))
    return af.relu_attention(af.block_sparse(s, block_mask)) @ v


def _graph(program):
    """``program``'s graph with its runtime inputs (after q, k, v: a block mask, a bias) as placeholders."""
    runtime_inputs = list(inspect.signature(program.fn).parameters)[3:]
    return program.graph(**{name: RuntimePlaceholder() for name in runtime_inputs})


@pytest.mark.parametrize("kind", ["forward", "dkdv", "dq", "decode"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # float16 lowers as bfloat16 does
@pytest.mark.parametrize("program", [block_sparse, composed], ids=["block_sparse", "composed"])
def test_a_block_sparse_programs_kernels_compile_for_sm90(tmp_path, monkeypatch, program, dtype, kind):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "kernels"))
    graph = _graph(program)
    config = KernelConfig(arch="sm90", dtype=dtype, head_dim=64, head_dim_v=64, group=2,
                          save_lse=graph.has_lse and kind in ("dkdv", "dq"), fp32_precision="ieee")  # fmt: skip
    # the check is the compile itself: Triton (or ptxas) raises on a kernel it cannot lower
    generated_resources(compiled(graph, config).plan, kind, shared_limit=SHARED_MEMORY_LIMIT)


@af.attention
def causal(q, k, v):
    return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v


@pytest.mark.parametrize(
    "program,varlen", [(causal, False), (block_sparse, True)], ids=["causal", "packed_block_sparse"]
)
def test_a_gqa_dkdv_loop_never_divides_by_its_step_count(tmp_path, monkeypatch, program, varlen):
    """The dK/dV kernel's flat (query head, block) loops divide the step by the loop's step count, which is 0 for a
    loop with nothing to do: a division by 0 is undefined, and with it an H100 read outside q in a packed float32
    call's kernel (its pipelined prologue computes the first step's addresses). Each division is by at least 1."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "kernels"))
    graph = _graph(program)
    config = KernelConfig(arch="sm90", dtype="float32", head_dim=32, head_dim_v=32, group=2, save_lse=True,
                          varlen=varlen, fp32_precision="ieee")  # fmt: skip
    source = compiled(graph, config).plan.kernels["dkdv"].source
    divisions = re.findall(r"\bt // ([^\n]+)", source)
    assert divisions and all(d == "tl.maximum(steps, 1)" for d in divisions), divisions


def test_a_float32_kernel_gets_the_registers_it_needs(tmp_path, monkeypatch):
    """Left to choose, ptxas gave a causal float32 dK/dV at head dim 64 with 64 x 64 tiles 32 registers and 79180
    spill bytes; float32 tiles on a GPU cap registers at 255 (``passes.tile.FLOAT32_REGISTER_CAP``), a plugin's
    too, which ptxas then uses. A bfloat16 kernel's tiles leave ptxas to choose."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "kernels"))
    graph = _graph(causal)
    config = KernelConfig(arch="sm90", dtype="float32", head_dim=64, head_dim_v=64, group=2, save_lse=True,
                          fp32_precision="ieee")  # fmt: skip
    plan = compiled(graph, config).plan
    assert all(spec.tiles.max_registers == FLOAT32_REGISTER_CAP for spec in plan.kernels.values())
    tiles = TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, max_registers=FLOAT32_REGISTER_CAP)
    assert generated_resources(plan, "dkdv", tiles=tiles).registers > 32
    bf16 = compiled(graph, attrs.evolve(config, dtype="bfloat16")).plan
    assert all(spec.tiles.max_registers is None for spec in bf16.kernels.values())


@pytest.mark.parametrize("kind", ["forward", "dkdv", "dq"])
def test_float32_kernels_hold_their_tiles_in_registers(tmp_path, monkeypatch, kind):
    """IEEE float32 dots run on the FMA units: with the table's tensor-core tiles a causal float32 kernel at head dim
    128 spilled tens of KB a thread (forward 34368 bytes, dK/dV 29412) and compiled for over a minute.
    ``FLOAT32_FMA_TILES``' head dim 128 row, an H100 sweep's fastest, spills a few KB (GQA forward 2996 bytes, dK/dV
    3048): the bound catches a slide back towards tens of KB."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "kernels"))
    monkeypatch.setenv(FLOAT32_FMA_GATE.env, "1")  # sm90 is checked; the variable keeps the test off that list
    graph = _graph(causal)
    config = KernelConfig(arch="sm90", dtype="float32", head_dim=128, head_dim_v=128, group=2, save_lse=True,
                          fp32_precision="ieee")  # fmt: skip
    plan = compiled(graph, config).plan
    assert plan.kernels[kind].tiles == float32_fma_tiles(kind, 128)
    used = generated_resources(plan, kind, shared_limit=SHARED_MEMORY_LIMIT)
    assert used.spill_bytes < 4096, used
