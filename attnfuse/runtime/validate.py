"""The values of a KV cache's ``kv_lens`` and ``block_table``, checked on the device, with no host sync.

A paged cache's kernels never read outside the pool whatever the table holds (a key on a page outside
it is absent), and no kernel reads past a cache's capacity whatever kv_lens holds (a longer length counts
as the capacity), but a bad entry still means a wrong answer for that sequence. So every call with
``kv_lens`` checks, unless the caller opts out (``validate=False``): each length is in [0, capacity] (Nk,
or block_table's max_pages * page_size; and at most 2**31 - 1), and each block_table entry a sequence
uses (the first ceil(kv_lens[b] / page_size) of row b) is a page of the pool, [0, num_pages). Entries past
those are unused and may hold anything (-1 padding). One program per sequence, in the call's stream,
writes the first bad entry it finds into the device's error record (``error_record.py``), which reports
it: at once on CPU, at a later call on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch_spec import CONSTEXPR, INT, STRIDE, TENSOR, LaunchSpec, Param, params
from . import error_record
from .interpreter import InterpretedKernel
from .kv_layout import pool_sizes
from .launcher import Launcher, next_power_of_2


def _check_kernel(
    KvLens,
    BlockTable,
    Record,
    stride_l,
    stride_btb,
    stride_btp,
    PAGE_SIZE,
    NUM_PAGES,
    CAPACITY,
    PAGED: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    b = tl.program_id(0)
    n = tl.load(KvLens + b * stride_l).to(tl.int64)
    kind = tl.where((n < 0) | (n > CAPACITY), 1, 0).to(tl.int64)  # error_record.BAD_LENGTH
    slot = tl.zeros((), tl.int64)
    value = n
    used = slot.to(tl.int32)
    if PAGED:
        used = ((tl.minimum(tl.maximum(n, 0), CAPACITY) + PAGE_SIZE - 1) // PAGE_SIZE).to(tl.int32)
        first = used
        for start in range(0, used, BLOCK_P):
            slots = start + tl.arange(0, BLOCK_P)
            page = tl.load(
                BlockTable + b.to(tl.int64) * stride_btb + slots.to(tl.int64) * stride_btp, mask=slots < used, other=0
            ).to(tl.int64)
            bad = (slots < used) & ((page < 0) | (page >= NUM_PAGES))
            first = tl.minimum(first, tl.min(tl.where(bad, slots, used), 0))
        bad_page = (kind == 0) & (first < used)
        page = tl.load(
            BlockTable + b.to(tl.int64) * stride_btb + first.to(tl.int64) * stride_btp, mask=bad_page, other=0
        ).to(tl.int64)  # read again, the one bad entry (no read when none)
        kind = tl.where(bad_page, 2, kind)  # error_record.BAD_PAGE
        slot = tl.where(bad_page, first.to(tl.int64), slot)
        value = tl.where(bad_page, page, value)
    if kind != 0:
        if tl.atomic_cas(Record, slot * 0, kind) == 0:  # the first error recorded wins; the fields follow it
            tl.store(Record + 1, b.to(tl.int64))
            tl.store(Record + 2, slot)
            tl.store(Record + 3, value)
            tl.store(Record + 4, n)
            tl.store(Record + 5, used.to(tl.int64))
            tl.store(Record + 6, slot * 0 + NUM_PAGES)
            tl.store(Record + 7, slot * 0 + PAGE_SIZE)
            tl.store(Record + 8, slot * 0 + CAPACITY)


CHECK = LaunchSpec(
    "_check_kernel",
    params(TENSOR, "KvLens", "BlockTable", "Record")
    + (Param("stride_l", STRIDE, "KvLens"),)
    + params(INT, "stride_btb", "stride_btp", "PAGE_SIZE", "NUM_PAGES", "CAPACITY")
    + params(CONSTEXPR, "PAGED", "BLOCK_P"),
    tiles=(),
)
_jitted = Launcher(triton.jit(_check_kernel))
_interpreted = InterpretedKernel(_check_kernel)


def check_cache_values(
    kv_lens: torch.Tensor,
    block_table: torch.Tensor | None,
    num_pages: int,
    page_size: int,
    capacity: int,
    *,
    wait: bool = False,
) -> None:
    """Check that every ``kv_lens`` (B,) value fits in [0, capacity] (the cache's key rows per sequence;
    at most 2**31 - 1 count) and every entry of ``block_table`` (B, max_pages) that a sequence uses is a
    page in [0, num_pages), in one launch that records the first bad value in the device's error record.
    An ``InputError`` names the sequence, slot and value: raised here on CPU; on CUDA by a later call or
    ``check_errors``, or here with ``wait`` (a host sync, which first reports an error recorded earlier).
    ``kv_lens`` and ``block_table`` have passed ``check_cache``; ``page_size`` is 0 without a table."""
    record = error_record.record_for(kv_lens.device)
    if wait:
        record.wait()
    B = kv_lens.shape[0]
    paged = block_table is not None
    table = block_table if paged else kv_lens
    max_pages = block_table.shape[1] if paged else 0
    kernel = _interpreted if kv_lens.device.type == "cpu" else _jitted
    stride_btb, stride_btp = table.stride() if paged else (0, 0)
    args = {
        "KvLens": kv_lens,
        "BlockTable": table,
        "stride_btb": stride_btb,
        "stride_btp": stride_btp,
        "PAGE_SIZE": max(page_size, 1) if paged else 0,
        "NUM_PAGES": num_pages,
        "CAPACITY": min(capacity, error_record.MAX_LENGTH),
    }
    constexprs = CHECK.constexprs({"PAGED": paged, "BLOCK_P": min(1024, max(16, next_power_of_2(max(max_pages, 1))))})

    def launch(values: torch.Tensor) -> None:
        if B:
            kernel.launch((B,), CHECK.bind({**args, "Record": values}), constexprs, device=kv_lens.device)

    record.run_check(launch)
    if wait:
        record.wait()


def check_call_values(
    k: torch.Tensor,
    kv_lens: torch.Tensor | None,
    block_table: torch.Tensor | None,
    *,
    kv_layout: str | None = "NHD",
    validate: bool = True,
    wait: bool = False,
) -> None:
    """A call's values of ``kv_lens`` and ``block_table`` (``k`` is the cache (B, Hkv, Nk, D), or a paged
    cache's pool in ``kv_layout``, the layout its call decided): nothing without kv_lens;
    ``check_cache_values`` when validating; otherwise only an error an earlier validated call recorded is
    reported (``error_record.report``), and nothing is checked."""
    if kv_lens is None:
        return
    if not validate:
        error_record.report(kv_lens.device)
        return
    if block_table is None:
        check_cache_values(kv_lens, None, 0, 0, k.shape[2], wait=wait)
        return
    page_size = pool_sizes(k.shape, kv_layout)[0]
    check_cache_values(kv_lens, block_table, k.shape[0], page_size, block_table.shape[1] * page_size, wait=wait)
