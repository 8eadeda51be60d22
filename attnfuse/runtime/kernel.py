"""One generated kernel, ready to launch: on the GPU through ``triton.jit``, on CPU tensors through the
interpreter. Its function is compiled from the source in memory (``source_cache.load_function``); the file on
disk is a readable copy. A launch that needs more shared memory than the GPU has retries with smaller tiles."""

from __future__ import annotations

from typing import Any, Callable

import attrs
import torch
import triton

from ..errors import InputError
from ..plan import KernelSpec, TileConfig
from ..triton_compat import OutOfResources
from .blame import blame
from .interpreter import InterpretedKernel
from .launcher import Launcher
from .source_cache import load_function, write_source


def smaller_tiles(tiles: TileConfig) -> TileConfig:
    """The next configuration to try when ``tiles`` needs more shared memory than the GPU has."""
    if tiles.num_stages > 1:
        return attrs.evolve(tiles, num_stages=tiles.num_stages - 1)
    if tiles.block_n > 16:
        return attrs.evolve(tiles, block_n=tiles.block_n // 2, num_stages=2)
    if tiles.block_m > 16:
        return attrs.evolve(tiles, block_m=tiles.block_m // 2, num_stages=2)
    raise InputError("no tile configuration fits this GPU's shared memory for these head dims")


class CompiledKernel:
    """A planned kernel's source, compiled in memory (a readable copy written to the on-disk cache) and
    launchable; launched on CPU tensors (``interpreted``) through Triton's interpreter."""

    def __init__(self, spec: KernelSpec, interpreted: bool):
        self.spec = spec
        self.name = spec.name
        self.source = spec.source
        self.path = write_source(self.name, self.source)
        fn = load_function(self.source, self.name, self.path)
        self._kernel = InterpretedKernel(fn) if interpreted else Launcher(triton.jit(fn))
        self.tiles = spec.tiles  # shrinks if the GPU lacks the shared memory the tile table assumed

    def launch(
        self,
        grid: Callable[[TileConfig], tuple[int, ...]],
        args: tuple,
        device: torch.device,
        block_m: int | None = None,
        limit: int | None = None,
        **constexprs: Any,
    ) -> None:
        """Launch ``args`` (from ``spec.launch.bind``) on ``grid(tiles)`` with BLOCK_M (``block_m`` if given),
        BLOCK_N, warps and stages from the current tiles; ``limit`` caps both block sizes (a block-sparse
        mask's block size). ``constexprs``: exactly the spec's launch constexprs; one given as a function
        of the tiles (``EVEN_K``, ``EVEN_M``) is evaluated for the tiles launched."""
        constexprs = self.spec.launch.constexprs(constexprs)
        while True:
            tiles = self.tiles
            if limit is not None and max(tiles.block_m, tiles.block_n) > limit:
                tiles = attrs.evolve(tiles, block_m=min(tiles.block_m, limit), block_n=min(tiles.block_n, limit))
            values = {k: v(tiles) if callable(v) else v for k, v in constexprs.items()}
            values["BLOCK_M"], values["BLOCK_N"] = block_m or tiles.block_m, tiles.block_n
            try:
                self._kernel.launch(
                    grid(tiles), args, values, tiles.num_warps, tiles.num_stages, device, maxnreg=tiles.max_registers
                )
                return
            except OutOfResources:
                self.tiles = smaller_tiles(self.tiles)
            except Exception as exc:
                culprit = blame(self.source, self.path, self.name, exc, self.spec.origins)
                if culprit is not None and hasattr(exc, "add_note"):
                    exc.add_note(culprit)
                raise
