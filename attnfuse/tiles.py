"""A kernel's tiles (``TileConfig``: its launch shape) and a rule choosing them (``TileRule``: what a
plugin's ``attnfuse_tile_configs`` hook returns; ``passes/tile.py`` holds the table of the built-in rules).
Imported by the Plan, the tile pass and the plugin API (``attnfuse.plugin``); it imports nothing of AttnFuse.
"""

from __future__ import annotations

from attrs import field, frozen


def _tile_size(_, attribute, value: int) -> None:
    if value < 16 or value & (value - 1):
        raise ValueError(f"{attribute.name} must be a power of two >= 16, got {value}")


def _register_cap(_, attribute, value: int | None) -> None:
    if value is not None and not 24 <= value <= 255:
        raise ValueError(f"{attribute.name} must be None or a register count from 24 to 255, got {value}")


@frozen(kw_only=True, repr=False)
class TileConfig:
    """Launch shape of one kernel: BLOCK_M query rows by BLOCK_N keys per step; ``max_registers``: the cap on a
    thread's registers it compiles with on a GPU (Triton's ``maxnreg``), None for ptxas' own choice."""

    block_m: int = field(validator=_tile_size)
    block_n: int = field(validator=_tile_size)
    num_warps: int = 4
    num_stages: int = 2
    max_registers: int | None = field(default=None, validator=_register_cap)

    def __repr__(self) -> str:
        # the register cap shows only when named: a template instance's digest (``kernels.instance``) hashes this
        # text, and the GPU record names the instances by digests made before the field
        cap = "" if self.max_registers is None else f", max_registers={self.max_registers}"
        return (
            f"TileConfig(block_m={self.block_m}, block_n={self.block_n}, num_warps={self.num_warps}, "
            f"num_stages={self.num_stages}{cap})"
        )


@frozen(kw_only=True)
class TileRule:
    """Use ``config`` for kernels on ``arch`` ("sm90", "sm80", ..., "interpreter", "*"), of ``variant``
    ("dense", "masked", "window", "listed", "rope", "*") and a head dim (padded to a power of two) in
    ``head_dim``, for ``kernel`` "forward", "dkdv" (BLOCK_M queries per step, BLOCK_N keys per program), "dq"
    (BLOCK_M queries per program, BLOCK_N keys per step), "decode" (BLOCK_M at most rows per program, BLOCK_N
    keys per step) or "*", whose q, k, v are of ``dtype`` ("bfloat16", "float16", "float32", "float64",
    "float8_e4m3fn", "float8_e5m2"; "float8" for either float8 type; "*")."""

    config: TileConfig
    arch: str = "*"
    variant: str = "*"
    head_dim: tuple[int, int] = (1, 512)
    kernel: str = "*"
    dtype: str = "*"

    def matches(self, kernel: str, arch: str, variant: str, head_dim: int, dtype: str | None = None) -> bool:
        """Whether the rule covers this kernel; ``dtype`` None (a caller that does not know it) matches only
        rules for any dtype."""
        return (
            self.kernel in ("*", kernel)
            and self.arch in ("*", arch)
            and self.variant in ("*", variant)
            and self.head_dim[0] <= head_dim <= self.head_dim[1]
            and (self.dtype == "*" or dtype is not None and self.dtype in (dtype, dtype.split("_")[0]))
        )
