"""legacy_tiles: tiles for sm80, chosen the way docs/plugins.md taught on 2026-11-30 (imports from
``attnfuse.passes.tile``, hooks that know no dtype)."""

from __future__ import annotations

import attnfuse
from attnfuse.passes.tile import TileConfig, TileRule

RULED = TileConfig(block_m=64, block_n=32, num_warps=4, num_stages=3)
CHOSEN = TileConfig(block_m=32, block_n=32, num_warps=2, num_stages=2)


@attnfuse.hookimpl
def attnfuse_tile_config(kernel, arch, variant, head_dim):
    if (kernel, arch, variant, head_dim) == ("dq", "sm80", "masked", 64):
        return CHOSEN
    return None


@attnfuse.hookimpl
def attnfuse_tile_configs():
    return [TileRule(arch="sm80", kernel="forward", variant="masked", head_dim=(65, 128), config=RULED)]
