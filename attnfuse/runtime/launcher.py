"""Launch a ``triton.jit`` kernel with little host time.

Triton's ``kernel[grid](...)`` binds and specialises every argument on every call (tens of µs for the
30-odd arguments of an attention kernel). ``Launcher`` does that once per specialisation: it keys each
call by what Triton specialises on (each tensor's dtype and 16-byte alignment; each integer's being 1,
a multiple of 16, or past 32 bits; the constexprs, warps and stages) and sends later calls with the same
key straight to the compiled kernel's C launcher. While a launch hook is installed (a profiler), every
call goes through Triton's own path, which feeds the hooks. Gluon kernels launch the same way; a TMA
descriptor argument is keyed by its tile, layout, dtype and alignment (Triton encodes it on every call).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import torch

from ..errors import InputError
from ..triton_compat import JITFunction, TensorDescriptor, driver, knobs


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) on the host (``triton.cdiv`` is a jit function: µs per call from Python)."""
    return -(-a // b)


GRID_YZ_LIMIT = 65535  # CUDA's largest grid size along y and along z (x: 2**31 - 1)


def head_grid(heads: int, what: str) -> tuple[int, int]:
    """The grid's (y, z) sizes for ``heads`` (batch x head) programs, y * z == heads, each at most
    GRID_YZ_LIMIT: (heads, 1) when they fit along y; a generated kernel's program takes head
    ``program_id(1) + program_id(2) * num_programs(1)``. ``what`` names the count in the error raised when
    no such split exists: one of more than 65535 sequences, whose count has no divisor between
    count / 65535 and 65535 (any count B x H with B and H at most 65535 splits)."""
    if heads <= GRID_YZ_LIMIT:
        return heads, 1
    for z in range(cdiv(heads, GRID_YZ_LIMIT), GRID_YZ_LIMIT + 1):
        if heads % z == 0:
            return heads // z, z
    raise InputError(
        f"{what} = {heads} programs cannot be laid out on a CUDA grid: above {GRID_YZ_LIMIT} they "
        f"are split over two grid dimensions of at most {GRID_YZ_LIMIT} each, and {heads} has no "
        f"divisor that allows it; pass at most {GRID_YZ_LIMIT} sequences a call"
    )


def block_grid(
    rows: int, heads: int, tile: str, listed_block: int | None = None, extra_blocks: int = 0, *, what: str
) -> Callable[[Any], tuple[int, ...]]:
    """The grid, as a function of the tiles, of a kernel with one program per (block of ``rows``, head):
    (row blocks, heads), or with more heads than a grid's y size, (row blocks, *``head_grid``); the block
    ``tiles.<tile>`` rows, and ``extra_blocks`` more (dK/dV's split blocks). ``listed_block``: the block size
    of the listing mask whose order the kernel follows (codegen's ``program``): (heads, slots), each listed
    block, and each extra one, taking listed_block // tile slots. ``what``: how the error names ``heads``."""
    if listed_block is None:
        y, z = head_grid(heads, what)
        return lambda tiles: (cdiv(rows, getattr(tiles, tile)) + extra_blocks, y, z)
    return lambda tiles: (heads, (cdiv(rows, listed_block) + extra_blocks) * (listed_block // getattr(tiles, tile)))


L2_SHARE = 0.75  # all heads together while their keys and values fill at most this share of the L2 cache
INTERPRETER_HEAD_GROUP = 3  # on CPU tensors: groups of 3 heads, so that the tests run the grouping


def query_grid(rows: int, heads: int, listed_block: int | None = None) -> Callable[[Any], tuple[int, ...]]:
    """The grid, as a function of the tiles, of a query-block kernel (forward, dQ) with ``heads`` (batch x
    query head) of ``rows`` rows: (blocks x heads,), which the kernel walks in groups of ``head_group``
    heads (codegen ``loops.program``); with a listing mask of ``listed_block``, ``block_grid``'s."""
    if listed_block is not None:
        return block_grid(rows, heads, "block_m", listed_block, what="B x Hq")
    return lambda tiles: (cdiv(rows, tiles.block_m) * heads,)


def head_group(heads: int, kv_bytes: int, device: torch.device) -> int:
    """HEAD_GROUP of a query-block kernel: how many of its ``heads`` run together, each block of theirs
    (the longest first) before the next. All of them when their keys and values (``kv_bytes`` in all) fit
    in L2_SHARE of the L2 cache: a causal grid's work then ends evenly. Else one head at a time, whose
    programs share the keys they read (``benchmarks/sweep_head_group.py``)."""
    if device.type != "cuda":
        return min(heads, INTERPRETER_HEAD_GROUP)
    return heads if kv_bytes <= L2_SHARE * l2_bytes(device) else 1


@functools.lru_cache(maxsize=None)
def l2_bytes(device: torch.device) -> int:
    """The GPU's L2 cache size in bytes."""
    return torch.cuda.get_device_properties(device).L2_cache_size


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """The GPU's multiprocessor count."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), on the host."""
    return 1 << (n - 1).bit_length()


def _int_key(a: int) -> tuple:
    return (a == 1, a % 16 == 0, -(2**31) <= a < 2**31, a < 2**63)


def _tensor_key(a: torch.Tensor) -> tuple:
    return (a.dtype, a.data_ptr() % 16 == 0)


def _descriptor_key(a: TensorDescriptor) -> tuple:
    return (tuple(a.block_shape), a.layout, a.padding, _tensor_key(a.base))


_KEYS: dict[type, Callable[[Any], Any]] = {
    int: _int_key,
    bool: lambda a: ("bool", a),
    float: lambda a: float,
    type(None): lambda a: None,
    torch.Tensor: _tensor_key,
    torch.nn.Parameter: _tensor_key,
    TensorDescriptor: _descriptor_key,
}


def specialisation_key(arg: Any) -> Any:
    """What Triton specialises a kernel on for ``arg``, or a finer key (never a coarser one)."""
    key = _KEYS.get(type(arg))
    if key is not None:
        return key(arg)
    if isinstance(arg, torch.Tensor):
        return _tensor_key(arg)
    return (type(arg), arg)


def call_key(args: tuple) -> tuple:
    """The specialisation keys of ``args``; an int32 other than 1 (most arguments: strides, sizes)
    takes the fast path, its divisibility by 16 alone, and so does a tensor, its dtype and alignment."""
    return tuple(
        [
            (a & 15 == 0 if 1 < a < 2**31 else _int_key(a))
            if type(a) is int
            else (a.dtype, a.data_ptr() & 15 == 0)
            if type(a) is torch.Tensor
            else specialisation_key(a)
            for a in args
        ]
    )


def _hooked(hook: Any) -> bool:
    """Whether a launch hook is installed (Triton 3.6 keeps an empty HookChain when none is)."""
    return hook is not None and bool(getattr(hook, "calls", True))


class Launcher:
    """``launcher.launch(grid, args, constexprs, num_warps, num_stages, device)``: ``triton.jit``'s
    ``kernel[grid](*args, **constexprs, num_warps=..., num_stages=...)``, with less host time.

    The generated kernels take their runtime arguments first and their constexprs last, so the
    constexprs are passed by keyword and appended in the kernel's order.
    """

    def __init__(self, fn: JITFunction):
        self.fn = fn
        flags = [p.is_constexpr for p in fn.params]
        first = flags.index(True) if True in flags else len(flags)
        if not all(flags[first:]):
            raise ValueError(f"{fn.__name__}: constexpr parameters must come after every runtime parameter")
        self._runtime_count = first
        self._constexpr_names = tuple(fn.arg_names[first:])
        self._compiled: dict[tuple, Any] = {}
        self._compiling = threading.Lock()  # a new specialisation compiles once, whichever threads launch it

    def launch(
        self,
        grid: tuple[int, ...],
        args: tuple,
        constexprs: dict[str, Any],
        num_warps: int = 4,
        num_stages: int = 2,
        device: torch.device | None = None,
        maxnreg: int | None = None,
    ) -> None:
        """Launch on ``grid`` in the current stream of ``device`` (the current device when None);
        ``maxnreg``: the register cap per thread (a warp-specialised kernel's budget), if any."""
        current = torch.cuda.current_device()
        if device is not None and device.index != current:
            with torch.cuda.device(device):
                return self.launch(grid, args, constexprs, num_warps, num_stages, maxnreg=maxnreg)
        if len(args) != self._runtime_count:
            raise TypeError(f"{self.fn.__name__} takes {self._runtime_count} runtime arguments, got {len(args)}")
        tail = tuple([constexprs[name] for name in self._constexpr_names])
        key = (current, num_warps, num_stages, maxnreg, tail, call_key(args))
        launch = self._compiled.get(key)
        hooked = _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook)
        if launch is None or hooked:
            with self._compiling:
                launch = None if hooked else self._compiled.get(key)
                if launch is None:
                    options = {"maxnreg": maxnreg} if maxnreg is not None else {}
                    self._compiled[key] = _direct_launch(
                        self.fn[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages, **options)
                    )
                    return
        launch(grid, driver.active.get_current_stream(current), args, tail)


def _direct_launch(kernel: Any) -> Callable[[tuple, int, tuple, tuple], None]:
    """launch(grid, stream, args, constexprs) for a compiled kernel: straight to Triton's C launcher when
    the kernel needs no scratch memory (Triton 3.6's launcher layout), else through ``kernel.run``."""
    run = kernel.run
    c_launch = getattr(run, "launch", None)
    if c_launch is None or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):

        def launch(grid, stream, args, tail):
            grid = (*grid, 1, 1)
            run(
                grid[0],
                grid[1],
                grid[2],
                stream,
                kernel.function,
                kernel.packed_metadata,
                None,
                None,
                None,
                *args,
                *tail,
            )

        return launch
    fixed = (
        kernel.function,
        run.launch_cooperative_grid,
        run.launch_pdl,
        None,
        None,
        kernel.packed_metadata,
        None,
        None,
        None,
    )

    def launch(grid, stream, args, tail):
        grid = (*grid, 1, 1)
        c_launch(grid[0], grid[1], grid[2], stream, *fixed, *args, *tail)

    return launch
