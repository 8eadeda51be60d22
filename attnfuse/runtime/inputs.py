"""Call inputs: checks with clear errors, the configuration part of the cache key, plugin arguments."""

from __future__ import annotations

import difflib
import operator
from typing import Any, NamedTuple

import torch

from .. import ir
from ..errors import InputError
from ..launch_context import LaunchContext
from ..plan import KernelConfig, accumulator_type
from .dropout import Dropout
from .dropout import launch_args as dropout_args
from .fp8 import FP8_DTYPES, Fp8
from .gpu_gate import device_arch
from .kv_layout import check_kv_layout, head_second, pool_layout
from .offsets import any_layout_fits, rows_fit
from .launcher import head_group
from .packed import Packed
from .packed import launch_args as packed_args

DTYPES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    **FP8_DTYPES,  # with descales (``fp8.py``)
}
_ACCUMULATORS = {dtype: getattr(torch, accumulator_type(name)) for dtype, name in DTYPES.items()}


MAX_HEAD_DIM = 256


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The torch dtype inputs of ``dtype`` accumulate in, as the kernels do (``plan.accumulator_type``)."""
    return _ACCUMULATORS[dtype]


MAX_POSITION = 2**31 - 1  # positions are int32 in the kernels
WIDE_POSITION = 2**30
"""From this magnitude on, positions are int64 in the kernels (``KernelConfig.wide_positions``): a mask's
facts and ``keep`` add a window side (below 2**30 for the built-ins, see ``sliding_window.UNBOUNDED``) to a
position, which stays within int32 only for positions below it."""


class Positions(NamedTuple):
    """Where a call's queries and keys sit in their sequence: query i at ``q_offset + i``, key j at
    ``k_offset + j``; ``seq_len``, the sequence's length (its number of keys: what fragments read as ``Nk``,
    and what masks' facts take as "no limit"), at least every position plus one."""

    q_offset: int
    k_offset: int
    seq_len: int


def wide_positions(Nq: int, capacity: int, positions: Positions | None) -> bool:
    """Whether some position of a call can reach ``WIDE_POSITION`` in magnitude: with ``positions``, those
    below ``seq_len``; without, queries from -Nq (Nq > Nk) and keys below the cache's ``capacity``. A symbolic
    size (a fake tensor's, under torch.compile) is never compared, so no shape guard is made: the op's body
    decides on the real sizes."""
    if positions is not None:
        return positions.seq_len > WIDE_POSITION
    return any(type(n) is int and n > WIDE_POSITION for n in (Nq, capacity))


def check_positions(
    q_offset: Any, k_offset: Any, seq_len: Any, Nq: int, Nk: int, kv_lens: Any = None, block_table: Any = None
) -> Positions | None:
    """The call's ``Positions``, or None when it gives none (bottom-right alignment). A missing offset is 0;
    ``seq_len`` defaults to the last position plus one. InputError naming the argument otherwise."""
    if q_offset is None and k_offset is None:
        if seq_len is not None:
            raise InputError(
                f"seq_len={seq_len!r} needs q_offset or k_offset: without them the call's keys are its whole sequence"
            )
        return None
    if kv_lens is not None or block_table is not None:
        raise InputError(
            "q_offset and k_offset cannot be combined with kv_lens or block_table: a cache's lengths "
            "already place its queries (query i of sequence b at i + kv_lens[b] - Nq)"
        )
    values = {}
    for name, value in (("q_offset", q_offset), ("k_offset", k_offset), ("seq_len", seq_len)):
        if value is None:
            continue
        try:
            values[name] = operator.index(value)
        except TypeError:
            raise InputError(f"{name} must be an int, got {type(value).__name__}") from None
        if isinstance(value, bool) or not 0 <= values[name] <= MAX_POSITION:
            raise InputError(f"{name} must be an int in [0, {MAX_POSITION}], got {value!r}")
    q_offset, k_offset = values.get("q_offset", 0), values.get("k_offset", 0)
    end = max(q_offset + Nq, k_offset + Nk)
    seq_len = values.get("seq_len", end)
    if not end <= seq_len <= MAX_POSITION:
        raise InputError(
            f"seq_len must be at least the last position plus one, max(q_offset + Nq, k_offset + Nk) "
            f"= max({q_offset} + {Nq}, {k_offset} + {Nk}) = {end}, and at most {MAX_POSITION}; got "
            f"{seq_len}"
        )
    return Positions(q_offset, k_offset, seq_len)


class KVCache(NamedTuple):
    """Keys and values as the kernels read them (a tuple: built on every call).

    ``k``, ``v``: 4-D views in (batch or page, head, row, dim) order: the inputs themselves, or a paged
    cache's pools as (pages, Hkv, page_size, D) views (``kv_layout.head_second``). ``capacity``: key
    positions a sequence can have (Nk, or block_table's pages times page_size). ``lens``: per-sequence key
    counts (B,) int32, or None when every sequence has ``capacity`` keys. ``positions``: where the call's
    queries and keys sit (``Positions``), or None: key j at j, query i at i + Nk - Nq (i + lens[b] - Nq).
    ``kv_layout``: a paged cache's pool layout, "NHD" or "HND" (``kv_layout.py``); None for a contiguous one.
    ``packed``: packed sequences' document offsets (``packed.Packed``), or None; ``capacity`` is then the
    packed length of k. ``fp8``: a float8 call's descales and out dtype (``fp8.Fp8``), or None.
    ``dropout``: the call's attention dropout (``dropout.Dropout``), or None.
    """

    k: torch.Tensor
    v: torch.Tensor
    capacity: int
    lens: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    page_size: int = 0
    positions: Positions | None = None
    kv_layout: str | None = None
    packed: Packed | None = None
    fp8: Fp8 | None = None
    dropout: Dropout | None = None


def launch_context(q: torch.Tensor, kv: KVCache) -> LaunchContext:
    B, Hq, Nq, D = q.shape
    at = {} if kv.positions is None else kv.positions._asdict()
    if kv.packed is not None:
        at.update(cu_seqlens_q=kv.packed.cu_q, cu_seqlens_k=kv.packed.cu_k)
    return LaunchContext(
        B=B,
        Hq=Hq,
        Hkv=kv.k.shape[1],
        Nq=Nq,
        Nk=kv.capacity,
        D=D,
        DV=kv.v.shape[3],
        device=q.device,
        dtype=q.dtype,
        kv_lens=kv.lens,
        **at,
    )


def check_input_names(graph: ir.MatMulPV, inputs: dict[str, Any]) -> None:
    """Raise an InputError unless ``inputs`` holds every runtime input the graph reads (by argument name),
    naming those missing, the names expected and, for a misspelling, the given name closest to each.
    Inputs the graph does not read are allowed: a program passes each of its tensor arguments, used or not."""
    expected = ir.input_names(graph)
    missing = [name for name in expected if name not in inputs]
    if not missing:
        return
    unknown = [name for name in inputs if name not in expected]
    hints = []
    for name in missing:
        close = difflib.get_close_matches(name, unknown, n=1)
        if close:
            hints.append(f"{name!r} for the given {close[0]!r}")
    raise InputError(
        f"inputs: the program reads the runtime input(s) {', '.join(map(repr, missing))}, which the "
        f"call does not give; it expects inputs named {', '.join(map(repr, expected))}"
        + (f", got {', '.join(map(repr, inputs))}" if inputs else ", got none")
        + (f"; did you mean {', '.join(hints)}?" if hints else "")
    )


def check_cache(
    q: torch.Tensor, k: Any, v: Any, kv_lens: Any = None, block_table: Any = None, kv_layout: Any = None
) -> KVCache:
    """Check q, k, v and the cache layout; return the KV view the kernels read.

    Contiguous cache: k (B, Hkv, Nk, D), v (B, Hkv, Nk, DV). Paged cache (``block_table`` given): k, v
    pools in ``kv_layout`` ("NHD": (num_pages, page_size, Hkv, D/DV); "HND": (num_pages, Hkv, page_size,
    D/DV); None: "NHD" unless the shape is ambiguous, see ``kv_layout.pool_layout``), ``block_table`` (B,
    max_pages) int32 or int64 page indices, and ``kv_lens`` (B,) int32 or int64 required.

    This checks types, shapes and devices only (once per call signature). The values of kv_lens (each in
    [0, capacity]) and block_table are checked on every call by ``validate.check_call_values`` unless the
    call passes ``validate=False``; without that check the kernels still never read outside the cache
    (see ``kv_cache``).
    """
    layout = check_inputs(q, k, v, paged=block_table is not None, kv_layout=kv_layout)
    if block_table is not None:
        if (
            not isinstance(block_table, torch.Tensor)
            or block_table.dim() != 2
            or block_table.shape[0] != q.shape[0]
            or block_table.dtype not in (torch.int32, torch.int64)
        ):
            raise InputError(
                f"block_table must be an int32 (or int64) tensor of shape (B, max_pages) = ({q.shape[0]}, "
                f"...), got "
                f"{getattr(block_table, 'dtype', type(block_table).__name__)} "
                f"{tuple(getattr(block_table, 'shape', ()))}"
            )
        if block_table.device != q.device:
            raise InputError(f"block_table is on {block_table.device}, q on {q.device}")
        if kv_lens is None:
            raise InputError("a paged cache (block_table given) needs kv_lens: the number of keys of each sequence")
    if kv_lens is not None:
        if (
            not isinstance(kv_lens, torch.Tensor)
            or kv_lens.shape != (q.shape[0],)
            or kv_lens.dtype not in (torch.int32, torch.int64)
        ):
            raise InputError(
                f"kv_lens must be an int32 (or int64) tensor of shape (B,) = ({q.shape[0]},), got "
                f"{getattr(kv_lens, 'dtype', type(kv_lens).__name__)} "
                f"{tuple(getattr(kv_lens, 'shape', ()))}"
            )
        if kv_lens.device != q.device:
            raise InputError(f"kv_lens is on {kv_lens.device}, q on {q.device}")
    return kv_cache(k, v, kv_lens, block_table, kv_layout=layout)


def kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_lens: torch.Tensor | None,
    block_table: torch.Tensor | None,
    positions: Positions | None = None,
    kv_layout: str | None = "NHD",
    packed: Packed | None = None,
    fp8: Fp8 | None = None,
    dropout: Dropout | None = None,
) -> KVCache:
    """The KV view of inputs :func:`check_cache` accepted, a paged cache's pools read in ``kv_layout``
    (the one it decided). It checks no values: lengths outside [0, capacity] count as the nearest bound,
    never wrapped; an int64 block table goes to the kernels as it is, which drop keys on pages outside the
    pool. ``positions``: the call's (checked); ``packed``: its document offsets (checked); ``fp8``: a float8
    call's descales (checked); ``dropout``: its attention dropout."""
    if block_table is not None:
        k, v = head_second(k, kv_layout), head_second(v, kv_layout)
    capacity = k.shape[2] if block_table is None else block_table.shape[1] * k.shape[2]
    if kv_lens is not None and kv_lens.dtype != torch.int32:
        kv_lens = kv_lens.clamp(0, capacity).to(torch.int32)
    if kv_lens is not None and not kv_lens.is_contiguous():
        kv_lens = kv_lens.contiguous()
    if block_table is None:
        return KVCache(
            k=k, v=v, capacity=capacity, lens=kv_lens, positions=positions, packed=packed, fp8=fp8, dropout=dropout
        )
    return KVCache(
        k=k,
        v=v,
        capacity=capacity,
        lens=kv_lens,
        block_table=block_table,
        page_size=k.shape[2],
        kv_layout=kv_layout,
        fp8=fp8,
    )


def check_inputs(q: Any, k: Any, v: Any, paged: bool = False, kv_layout: Any = None) -> str | None:
    """Raise InputError unless q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, DV) fit together
    (with ``paged``: k, v pools (pages, page_size, Hkv, D/DV) or, in ``kv_layout`` "HND", (pages, Hkv,
    page_size, D/DV)). Returns the layout a paged call's pools are read in (``kv_layout.pool_layout``)."""
    check_kv_layout(kv_layout, paged)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise InputError(f"{name} must be 4-D (B, H, N, D), got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise InputError(
                f"{name} has dtype {t.dtype}; allowed: float16, bfloat16, float32, float64, and float8_e4m3fn, "
                f"float8_e5m2 with q_descale, k_descale, v_descale"
            )
    if not q.dtype == k.dtype == v.dtype:
        raise InputError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not q.device == k.device == v.device:
        raise InputError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if q.device.type not in ("cuda", "cpu"):
        raise InputError(f"tensors on {q.device.type} are not supported; use a CUDA device, or the CPU")
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        raise InputError(
            "bfloat16 on the CPU would run through Triton's interpreter, which computes bfloat16 "
            "wrongly; use float16 or float32 on the CPU, or a CUDA device"
        )
    layout = None
    if paged:
        if k.shape[:3] != v.shape[:3]:
            raise InputError(
                f"paged k and v must be pools (pages, page_size, Hkv, D) (or, with kv_layout='HND', "
                f"(pages, Hkv, page_size, D)) with the same pages, page size and heads, got "
                f"{tuple(k.shape)} and {tuple(v.shape)}"
            )
        layout = pool_layout(q.shape[1], tuple(k.shape), kv_layout)
        k, v = head_second(k, layout), head_second(v, layout)
    (B, Hq, _, D), (Bk, Hkv, Nk, Dk), (Bv, Hv, Nv, DV) = q.shape, k.shape, v.shape
    if not paged and not B == Bk == Bv:
        raise InputError(f"q, k and v must share the batch size, got {B}, {Bk}, {Bv}")
    if Hkv != Hv:
        raise InputError(f"k and v must have the same number of heads, got {Hkv} and {Hv}")
    if Hkv == 0 or Hq % Hkv:
        read = "" if layout is None else f", the pools read as kv_layout={layout!r}"
        raise InputError(f"q's head count Hq={Hq} must be a multiple of k's and v's Hkv={Hkv} (GQA/MQA{read})")
    if D != Dk:
        raise InputError(f"q and k must have the same head dim, got {D} and {Dk}")
    if Nk != Nv:
        raise InputError(f"k and v must have the same sequence length, got {Nk} and {Nv}")
    for name, dim in (("q and k", D), ("v", DV)):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise InputError(f"the head dim of {name} must be between 1 and {MAX_HEAD_DIM}, got {dim}")
    return layout


def kernel_config(
    q: torch.Tensor, kv: KVCache, save_lse: bool, inputs_wide: bool = False, dropout: bool = False
) -> KernelConfig:
    """The configuration part of the kernel-cache key for these inputs; ``inputs_wide``: some runtime
    input tensor needs 64-bit offsets (``offsets.inputs_fit``); ``dropout``: the call has attention dropout."""
    tf32 = q.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
    return KernelConfig(
        arch=device_arch(q.device),
        dtype=DTYPES[q.dtype],
        head_dim=q.shape[3],
        head_dim_v=kv.v.shape[3],
        group=q.shape[1] // kv.k.shape[1],
        save_lse=save_lse,
        fp32_precision="tf32" if tf32 else "ieee",
        kv_lens=kv.lens is not None,
        paged=kv.block_table is not None,
        wide_offsets=inputs_wide or not _rows_fit(q, kv),
        positions=kv.positions is not None,
        wide_positions=wide_positions(q.shape[2], kv.capacity, kv.positions),
        varlen=kv.packed is not None,
        dropout=dropout,
    )


def _rows_fit(q: torch.Tensor, kv: KVCache) -> bool:
    """Whether the row and column offsets of q, k, v and of the outputs, gradients and transformed copies
    the runtime allocates in their memory orders (head dim up to max(D, DV)) fit int32 kernels."""
    width = max(q.shape[3], kv.v.shape[3])
    tensors = (q, kv.k, kv.v)
    if all(rows_fit(t) and any_layout_fits(t, width) for t in tensors):
        return True  # the common case, decided without building the layouts
    return all(map(rows_fit, tensors)) and _layouts_fit(tensors, width)


def _layouts_fit(tensors: tuple[torch.Tensor, ...], width: int) -> bool:
    """Whether the tensors the runtime allocates in the memory orders of ``tensors`` with last dim ``width``
    fit int32 kernels (built on the meta device)."""
    metas = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in tensors]
    return all(rows_fit(empty_like_layout(m, width, m.dtype)) for m in metas)


def kv_launch_args(kv: KVCache) -> dict[str, Any]:
    """The kernel arguments of the cache by name: its capacity ``N_K``, lengths, and a paged cache's block
    table (its strides come with it), page size and number of pages; or the call's positions; or packed
    sequences' offsets; and the call's attention dropout's."""
    args: dict[str, Any] = {"N_K": kv.capacity, **position_args(kv), **dropout_args(kv.dropout)}
    if kv.packed is not None:
        args.update(packed_args(kv.packed))
    if kv.lens is not None:
        args["KvLens"] = kv.lens
    if kv.block_table is not None:
        args.update(BlockTable=kv.block_table, PAGE_SIZE=kv.page_size, NUM_PAGES=kv.k.shape[0])
    return args


def position_args(kv: KVCache) -> dict[str, int]:
    """The kernel arguments of the call's positions by name (none when it gives none)."""
    at = kv.positions
    return {} if at is None else {"Q_OFFSET": at.q_offset, "K_OFFSET": at.k_offset, "N_SEQ": at.seq_len}


def heads_together(q: torch.Tensor, kv: KVCache) -> int:
    """HEAD_GROUP of a forward or dQ launch on q (B, Hq, Nq, D) (``launcher.head_group``): each of the
    B x Hkv kv heads holds its capacity of rows of keys and values."""
    k, v = kv.k, kv.v
    kv_bytes = q.shape[0] * k.shape[1] * kv.capacity * (k.shape[3] * k.element_size() + v.shape[3] * v.element_size())
    return head_group(q.shape[0] * q.shape[1], kv_bytes, q.device)


def even_keys(kv: KVCache) -> Any:
    """EVEN_K of a launch, as a function of its tiles: every sequence has the cache's capacity of keys,
    and that is a multiple of BLOCK_N (never so for packed sequences)."""
    if kv.lens is not None or kv.packed is not None:
        return False
    return lambda tiles: kv.capacity % tiles.block_n == 0


def empty_like_layout(t: torch.Tensor, last_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor shaped like ``t`` but for its last dim, with ``t``'s memory order."""
    if t.is_contiguous():
        return (
            torch.empty_like(t, dtype=dtype)
            if last_dim == t.shape[-1]
            else torch.empty((*t.shape[:-1], last_dim), dtype=dtype, device=t.device)
        )
    shape = (*t.shape[:-1], last_dim)
    order = sorted(range(t.dim()), key=lambda i: -t.stride(i))
    buffer = torch.empty([shape[i] for i in order], dtype=dtype, device=t.device)
    return buffer.permute(*sorted(range(t.dim()), key=order.__getitem__))
