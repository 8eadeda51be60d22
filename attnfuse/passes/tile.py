"""Tiles: block sizes, warps and pipeline stages from a table keyed by arch, variant and head dim. Not a pass of
its own: ``lower`` calls ``choose_tiles`` for each kernel and keeps the answers in the ``LoweredProgram``.

Plugins choose first (hooks ``attnfuse_tile_config``, then the rules of ``attnfuse_tile_configs``); where none
does, the first rule of the table that matches wins: it runs from specific to general and ends with a rule
that matches everything.
"""

from __future__ import annotations

import attrs

from ..errors import PluginError
from ..plugin_manager import tile_config
from ..runtime.gpu_gate import Gate
from ..tiles import TileConfig, TileRule


T = TileConfig
TABLE: tuple[TileRule, ...] = (
    # Interpreter: small tiles keep CPU runs quick and put several blocks in small test shapes.
    TileRule(arch="interpreter", kernel="decode", config=T(block_m=32, block_n=16, num_warps=1, num_stages=1)),
    TileRule(arch="interpreter", config=T(block_m=32, block_n=32, num_warps=1, num_stages=1)),
    # H100/H200: the winners of tile sweeps on an H200 (benchmarks/sweep_tiles.py, through the tile-rule hook).
    # Float8 forwards: swept on an H100 (sweep_tiles.py --fp8); 128 x 128 spills at D 128 and ran 1.8x slower;
    # at D 64, 128 x 64 w4 (5% faster without RoPE) spills with it.
    TileRule(
        arch="sm90",
        kernel="forward",
        dtype="float8",
        head_dim=(1, 64),
        config=T(block_m=128, block_n=32, num_warps=4, num_stages=3),
    ),
    TileRule(
        arch="sm90",
        kernel="forward",
        dtype="float8",
        head_dim=(65, 128),
        config=T(block_m=128, block_n=64, num_warps=8, num_stages=3),
    ),
    TileRule(
        arch="sm90", kernel="forward", head_dim=(1, 64), config=T(block_m=64, block_n=64, num_warps=4, num_stages=3)
    ),
    TileRule(
        arch="sm90",
        kernel="forward",
        variant="window",
        head_dim=(65, 128),
        config=T(block_m=64, block_n=64, num_warps=4, num_stages=3),
    ),
    TileRule(
        arch="sm90",
        kernel="forward",
        variant="listed",
        head_dim=(65, 128),
        config=T(block_m=128, block_n=64, num_warps=4, num_stages=2),
    ),
    TileRule(
        arch="sm90", kernel="forward", head_dim=(65, 128), config=T(block_m=128, block_n=128, num_warps=8, num_stages=3)
    ),
    TileRule(arch="sm90", kernel="dkdv", head_dim=(1, 64), config=T(block_m=64, block_n=64, num_warps=4, num_stages=3)),
    TileRule(
        arch="sm90", kernel="dkdv", head_dim=(65, 128), config=T(block_m=64, block_n=64, num_warps=4, num_stages=2)
    ),
    TileRule(arch="sm90", kernel="dq", head_dim=(1, 64), config=T(block_m=64, block_n=64, num_warps=4, num_stages=3)),
    TileRule(
        arch="sm90",
        kernel="dq",
        variant="listed",
        head_dim=(65, 128),
        config=T(block_m=64, block_n=64, num_warps=4, num_stages=3),
    ),
    TileRule(
        arch="sm90", kernel="dq", head_dim=(65, 128), config=T(block_m=128, block_n=64, num_warps=8, num_stages=3)
    ),
    TileRule(arch="sm90", head_dim=(129, 256), config=T(block_m=64, block_n=64, num_warps=4, num_stages=2)),
    # Split-KV decoding, swept on the H200 with runtime.decode.PROGRAMS_PER_SM = 2
    # (benchmarks/sweep_tiles.py --kernel decode).
    TileRule(
        arch="sm90", kernel="decode", head_dim=(1, 128), config=T(block_m=64, block_n=64, num_warps=4, num_stages=3)
    ),
    # Any other GPU: conservative tiles that fit every recent part's shared memory.
    TileRule(head_dim=(1, 128), config=T(block_m=64, block_n=64, num_warps=4, num_stages=2)),
    TileRule(config=T(block_m=64, block_n=32, num_warps=4, num_stages=1)),
)


def _head_dims(lo: int, hi: int) -> str:
    if (lo, hi) == (1, 512):
        return "any"
    return f"≤ {hi}" if lo == 1 else f"{lo}–{hi}"


def markdown_table(rules: tuple[TileRule, ...] = TABLE) -> str:
    """``rules`` as docs/plugins.md shows the table: one row per rule, in the order they are searched."""
    lines = [
        "| arch | kernel | variant | head dim | dtype | BLOCK_M × BLOCK_N, warps, stages |",
        "|---|---|---|---|---|---|",
    ]
    for rule in rules:
        c = rule.config
        lines.append(
            f"| `{rule.arch}` | `{rule.kernel}` | `{rule.variant}` | {_head_dims(*rule.head_dim)} | `{rule.dtype}` | "
            f"{c.block_m} × {c.block_n}, {c.num_warps}, {c.num_stages} |"
        )
    return "\n".join(lines)


# A float32 kernel's dots run on the FMA units (no tensor core takes IEEE float32), and its tiles need more than a
# thread's 255 registers; left to choose, ptxas gives such a kernel 32 registers and spills 4 to 8 times more (a
# causal float32 dK/dV at head dim 128 on sm_90a: 126276 spill bytes, against 27316 with the cap). So a GPU
# compiles float32 kernels with the cap at every register a thread may have, unless the tiles name one.
FLOAT32_REGISTER_CAP = 255
# The table's tiles are tensor cores' (TF32 dots, allowed by torch.backends.cuda.matmul.allow_tf32, use them too).
# IEEE float32 dots hold their tiles in registers, where those spill tens of KB a thread and compile for minutes
# (sm_90a, head dim 128: a causal forward at 128 x 128 w8, 34368 spill bytes in 81 s; dK/dV at 64 x 64 w4, 29412 in
# 88 s). `python benchmarks/kernel_resources.py gpt2 --dtype float32 --kernel dkdv --tiles 32,32,8,2 64,64,4,2`
# shows it. The rows below are an H100's winners (`python benchmarks/sweep_tiles.py --float32 [--kernel backward]`,
# causal, N 4096: GPT-2's head dim 64, Llama-3-8B's 128); head dims above 128 take 32 x 32 with 8 warps, which
# spills nothing at 256 (not timed: no benchmark geometry has it). A GPU takes them by default only on the
# architectures their gate has checked, elsewhere only when its environment variable asks.
FMA_TILED_KERNELS = ("forward", "dkdv", "dq")


def _fma(block_m: int, block_n: int, num_warps: int) -> TileConfig:
    return TileConfig(
        block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=2, max_registers=FLOAT32_REGISTER_CAP
    )


FLOAT32_FMA_TILES = (  # (largest head dim, {kernel: tiles}), searched in order
    (64, {"forward": _fma(64, 64, 4), "dkdv": _fma(64, 32, 4), "dq": _fma(64, 64, 4)}),
    (128, {"forward": _fma(64, 64, 8), "dkdv": _fma(32, 32, 4), "dq": _fma(32, 32, 4)}),
    (256, dict.fromkeys(FMA_TILED_KERNELS, _fma(32, 32, 8))),
)
FLOAT32_FMA_GATE = Gate(
    "float32 FMA tiles",
    "ATTNFUSE_FLOAT32_FMA_TILES",
    "tests/test_gpu.py::test_float32_fma_tiles_match_the_reference",
    checked=("sm90",),
)


def choose_tiles(
    arch: str, variant: str, head_dim: int, kernel: str, dtype: str, fp32_precision: str = "ieee"
) -> TileConfig:
    """The tiles plugins choose (``plugin_manager.tile_config``), else ``float32_fma_tiles`` for a float32 forward,
    dK/dV or dQ kernel whose dots are IEEE (``fp32_precision``) on a GPU its gate opens, else the first
    matching rule's of the table; a float32 kernel's on a GPU with ``FLOAT32_REGISTER_CAP`` where they name none."""
    config = tile_config(kernel, arch, variant, head_dim, dtype)
    if config is not None and not isinstance(config, TileConfig):
        raise PluginError(
            f"a plugin chose {config!r} as the tiles of the {kernel} kernel (arch {arch}, variant "
            f"{variant}, head dim {head_dim}, dtype {dtype}); a tile hook must give an attnfuse.plugin.TileConfig"
        )
    on_gpu_float32 = dtype == "float32" and arch != "interpreter"
    ieee = on_gpu_float32 and fp32_precision == "ieee" and kernel in FMA_TILED_KERNELS
    if config is None and ieee and FLOAT32_FMA_GATE.opens_on(arch):
        return float32_fma_tiles(kernel, head_dim)
    config = config or _table_tiles(arch, variant, head_dim, kernel, dtype)
    if on_gpu_float32 and config.max_registers is None:
        return attrs.evolve(config, max_registers=FLOAT32_REGISTER_CAP)
    return config


def float32_fma_tiles(kernel: str, head_dim: int) -> TileConfig:
    """``FLOAT32_FMA_TILES``' tiles of ``kernel`` (one of ``FMA_TILED_KERNELS``) at ``head_dim`` (1 to 256)."""
    return next(tiles[kernel] for largest, tiles in FLOAT32_FMA_TILES if head_dim <= largest)


def _table_tiles(arch: str, variant: str, head_dim: int, kernel: str, dtype: str) -> TileConfig:
    for rule in TABLE:
        if rule.matches(kernel, arch, variant, head_dim, dtype):
            return rule.config
    raise LookupError(
        f"no tile rule for kernel={kernel} arch={arch} variant={variant} head_dim={head_dim} dtype={dtype}"
    )
