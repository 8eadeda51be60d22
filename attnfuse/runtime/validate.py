"""The values of a KV cache's ``kv_lens`` and ``block_table``, checked in one launch and one host sync.

A paged cache's kernels never read outside the pool whatever the table holds (a key on a page outside
it is absent), but a bad entry still means a wrong answer for that sequence. So every call with
``kv_lens`` checks, unless the caller opts out (``validate=False``): each length is in [0, 2**31 - 1],
and each block_table entry a sequence uses (the first ceil(min(kv_lens[b], capacity) / page_size) of
row b) is a page of the pool, [0, num_pages). Entries past those are unused and may hold anything (-1
padding). One program per sequence writes its status; one copy to the host reads them all.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import InputError
from ..launch_spec import CONSTEXPR, INT, STRIDE, TENSOR, LaunchSpec, Param, params
from .interpreter import InterpretedKernel
from .launcher import Launcher, next_power_of_2

OK, BAD_LENGTH = -1, -2  # statuses; a status >= 0 is the first bad page slot of the sequence
MAX_LENGTH = 2**31 - 1


def _check_kernel(KvLens, BlockTable, Status, stride_l, stride_btb, stride_btp, PAGE_SIZE, NUM_PAGES, CAPACITY,
                  PAGED: tl.constexpr, BLOCK_P: tl.constexpr):
    b = tl.program_id(0)
    n = tl.load(KvLens + b * stride_l).to(tl.int64)
    status = tl.where((n < 0) | (n > 2147483647), -2, -1)
    if PAGED:
        used = ((tl.minimum(tl.maximum(n, 0), CAPACITY) + PAGE_SIZE - 1) // PAGE_SIZE).to(tl.int32)
        first = used
        for start in range(0, used, BLOCK_P):
            slot = start + tl.arange(0, BLOCK_P)
            page = tl.load(BlockTable + b.to(tl.int64) * stride_btb + slot.to(tl.int64) * stride_btp,
                           mask=slot < used, other=0).to(tl.int64)
            bad = (slot < used) & ((page < 0) | (page >= NUM_PAGES))
            first = tl.minimum(first, tl.min(tl.where(bad, slot, used), 0))
        status = tl.where((status == -1) & (first < used), first, status)
    tl.store(Status + b, status)


CHECK = LaunchSpec("_check_kernel", params(TENSOR, "KvLens", "BlockTable", "Status")
                   + (Param("stride_l", STRIDE, "KvLens"),) + params(INT, "stride_btb", "stride_btp", "PAGE_SIZE",
                                                                    "NUM_PAGES", "CAPACITY")
                   + params(CONSTEXPR, "PAGED", "BLOCK_P"), tiles=())
_jitted = Launcher(triton.jit(_check_kernel))
_interpreted = InterpretedKernel(_check_kernel)


def check_cache_values(kv_lens: torch.Tensor, block_table: torch.Tensor | None, num_pages: int,
                       page_size: int) -> None:
    """Raise InputError, naming the sequence, slot and value, unless every ``kv_lens`` (B,) value fits
    in [0, 2**31 - 1] and every entry of ``block_table`` (B, max_pages) that a sequence uses is a page
    in [0, num_pages). ``kv_lens`` and ``block_table`` have passed ``check_cache``."""
    B = kv_lens.shape[0]
    if B == 0:
        return
    if kv_lens.is_cuda and torch.cuda.is_current_stream_capturing():
        raise InputError("validating kv_lens and block_table reads them on the host, which a CUDA graph "
                         "capture cannot; pass validate=False (the kernels still read nothing outside the cache)")
    status = torch.empty(B, dtype=torch.int32, device=kv_lens.device)
    paged = block_table is not None
    table = block_table if paged else kv_lens
    max_pages = block_table.shape[1] if paged else 0
    kernel = _interpreted if kv_lens.device.type == "cpu" else _jitted
    stride_btb, stride_btp = table.stride() if paged else (0, 0)
    kernel.launch((B,), CHECK.bind({"KvLens": kv_lens, "BlockTable": table, "Status": status, "stride_btb": stride_btb,
                                    "stride_btp": stride_btp, "PAGE_SIZE": max(page_size, 1), "NUM_PAGES": num_pages,
                                    "CAPACITY": max_pages * page_size}),
                  CHECK.constexprs({"PAGED": paged, "BLOCK_P": min(1024, max(16, next_power_of_2(max(max_pages, 1))))}),
                  device=kv_lens.device)
    statuses = status.tolist()  # the one host sync
    if min(statuses) == OK == max(statuses):
        return
    for b, s in enumerate(statuses):
        if s == BAD_LENGTH:
            raise InputError(f"kv_lens[{b}] = {int(kv_lens[b])}: a sequence's key count must be in "
                             f"[0, {MAX_LENGTH}]")
        if s >= 0:
            used = -(-min(int(kv_lens[b]), max_pages * page_size) // page_size)
            raise InputError(f"block_table[{b}, {s}] = {int(block_table[b, s])} is not a page of the pool: the "
                             f"{used} entries sequence {b} uses (kv_lens[{b}] = {int(kv_lens[b])}, page_size "
                             f"{page_size}) must each be in [0, {num_pages})")
