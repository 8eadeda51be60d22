"""Which blocks a program visits: its place in the grid (block order of a listing mask), the block ranges
the masks' facts give, and the masked / unmasked / block-list loops over them."""

from __future__ import annotations

from ..lower import LoweredProgram, masked_head
from . import packed
from .common import columns
from .text import indent
from .operands import key_count, key_rows, key_shift, kv_length, position, query_shift
from .scores import has_masks


def query_block(kernel: LoweredProgram, even_queries: bool = False, moved: tuple[tuple[str, ...], ...] = ()) -> str:
    """Program -> (query block, batch, query head, kv head): the block's rows, their positions, and the span
    ``q_lo`` .. ``q_hi`` of positions the masks' facts take. The longest rows start first (see ``program``).
    ``even_queries``: the kernel takes EVEN_M (Nq a multiple of BLOCK_M), which makes ``q_ok`` constant
    true, so the row masks of q's load and out's store drop (and the registers they hold). ``moved``: packed
    sequences' pointers to q's rows and to k's rows, which move to the program's document (``program``)."""
    q_ok = "(q_idx < Nq) | EVEN_M" if even_queries else "q_idx < Nq"
    shift = query_shift(kernel)
    return (
        program(kernel, "pid_m", "BLOCK_M", "Nq", moved=moved)
        + "b = pid_bh // HQ\nh = pid_bh % HQ\nhk = h // GROUP\n"
        + kv_length(kernel)
        + f"q_idx = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)\nq_pos = {position(kernel, f'q_idx + {shift}')}\n"
        + f"q_ok = {q_ok}\nq_lo = {position(kernel, f'pid_m * BLOCK_M + {shift}')}\n"
        + f"q_hi = {position(kernel, f'tl.minimum(pid_m * BLOCK_M + BLOCK_M, Nq) - 1 + {shift}')}\n"
        + columns(kernel)
        + "q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh\n"
    )


# Grid (blocks, heads) or, past a grid's y size, (blocks, y, z) with y * z heads (runtime ``head_grid``)
HEAD_OF_PROGRAM = "pid_bh = tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)\n"
HEAD_GROUP = "HEAD_GROUP"  # query-block kernels without a listing mask: heads per group, a runtime int


def _grouped(pid: str, block: str, blocks: str) -> str:
    """Grid (blocks x heads,): the heads in groups of HEAD_GROUP (the last may be smaller), a group's
    blocks last first, each block for every head of the group before the next (runtime ``query_grid``)."""
    return (
        "# heads in groups of HEAD_GROUP; in a group, each block (last first) for all its heads\n"
        f"blocks = {blocks}\npid = tl.program_id(0)\n"
        f"head_lo = pid // ({HEAD_GROUP} * blocks) * {HEAD_GROUP}\n"
        f"group_heads = tl.minimum({HEAD_GROUP}, tl.num_programs(0) // blocks - head_lo)\n"
        f"slot = pid - head_lo * blocks\n{pid} = blocks - 1 - slot // group_heads\n"
        "pid_bh = head_lo + slot % group_heads\n"
    )


def program(
    kernel: LoweredProgram, pid: str, block: str, rows: str, transposed: bool = False, moved: tuple = ()
) -> str:
    """This program's block ``pid`` (of ``block`` rows; ``rows`` in all) and ``pid_bh`` (batch x head).

    Query blocks: grid (blocks x heads,), the heads in groups of HEAD_GROUP whose keys and values share the
    L2 cache, a group's blocks last first, each for all its heads (the longest causal rows start first);
    key blocks (``transposed``): grid (blocks, heads) in order (``HEAD_OF_PROGRAM``: past 65535 heads,
    (blocks, y, z));
    or, when the listing mask orders its blocks (key blocks when ``transposed``), grid (heads, slots):
    slot by slot its blocks heaviest first, each block of its size taking size // ``block`` programs, of
    which one past ``rows`` returns at once. With ``split_heads`` (dK/dV), the slots of the first blocks
    come GROUP times, one program per query head of the group: ``one_head``, heads ``g_lo`` .. ``g_hi``.

    Packed sequences (``varlen``, no listing mask): the grid's blocks are ``packed.virtual_blocks``; then
    ``packed.document`` takes the block to its document, and moves the pointers ``moved`` (q's rows, then
    k's) there."""
    if kernel.config.varlen:
        side = "k" if transposed else "q"
        found = packed.document(pid, block, side, *moved)
        if not transposed:
            return _grouped(pid, block, packed.virtual_blocks(block, "Nq")) + found
        return _placed(kernel, pid) + found
    m = listing_mask(kernel)
    order = None if m is None else (m.fragment.block_list.q_order if transposed else m.fragment.block_list.order)
    heavy = split_heads(kernel) if transposed else None
    if order is None:
        if not transposed:
            return _grouped(pid, block, f"tl.cdiv({rows}, {block})")
        return _placed(kernel, pid)
    code = (
        f"# slots run {m.prefix}'s blocks heaviest first, each for every head before the next\n"
        f"pid_bh = tl.program_id(0)\nrun_tiles = {m.code(m.fragment.block_list.size)} // {block}\n"
        "slot = tl.program_id(1)\n"
    )
    if heavy is not None:
        code += _split_slots(
            f"# the first {heavy} blocks' slots come once per query head of the group", f"{heavy} * run_tiles"
        )
    return code + (
        f"{pid} = {m.code(order, slot='slot // run_tiles')} * run_tiles + slot % run_tiles\n"
        f"if {pid} * {block} >= {rows}:\n    return\n"
    )


def _placed(kernel: LoweredProgram, pid: str) -> str:
    """Key blocks without a listing mask: grid (blocks, heads) in order, the first blocks (under causal
    masks, the heaviest) split over a GQA group's query heads where the kernel splits any."""
    heavy = split_heads(kernel)
    if heavy is None:
        return f"{pid} = tl.program_id(0)\n" + HEAD_OF_PROGRAM
    return (
        HEAD_OF_PROGRAM
        + "slot = tl.program_id(0)\n"
        + _split_slots(f"# the first {heavy} key blocks come once per query head of the group", heavy)
        + f"{pid} = slot\n"
    )


def _split_slots(comment: str, split_slots: str) -> str:
    """Slots ``slot`` -> the one-head programs of the first ``split_slots`` slots (GROUP each, head
    ``slot % GROUP``), then the slots after them, each for every head; ``slot`` becomes the slot's index."""
    return (
        f"{comment}\nsplit_slots = {split_slots}\none_head = slot < split_slots * GROUP\n"
        "g_lo = tl.where(one_head, slot % GROUP, 0)\ng_hi = tl.where(one_head, slot % GROUP + 1, GROUP)\n"
        "slot = tl.where(one_head, slot // GROUP, slot - split_slots * (GROUP - 1))\n"
    )


SPLIT_BLOCKS = "SPLIT_BLOCKS"  # dK/dV of a GQA program without a listing mask: a runtime int parameter


def split_heads(kernel: LoweredProgram) -> str | None:
    """Code of the number of key blocks whose dK/dV the kernel splits over the query heads of a GQA group,
    if it splits any: with a listing mask, the first in its order (``BlockList.q_split``); without one,
    the first ``SPLIT_BLOCKS``, the runtime's choice (all of a small grid's, or none)."""
    m = listing_mask(kernel)
    if kernel.config.group == 1:
        return None
    if m is None:
        return SPLIT_BLOCKS
    if not scheduled(kernel, transposed=True) or m.fragment.block_list.q_split is None:
        return None
    return m.code(m.fragment.block_list.q_split)


def scheduled(kernel: LoweredProgram, transposed: bool = False) -> bool:
    """Whether the kernel's programs follow a listing mask's block order (see ``program``)."""
    m = listing_mask(kernel)
    return m is not None and (m.fragment.block_list.q_order if transposed else m.fragment.block_list.order) is not None


def key_block(kernel: LoweredProgram, even_keys: bool = False) -> str:
    """Program (key block ``pid_n``, batch x kv head ``pid_bh``) -> batch, kv head, ``Nk`` and the block's
    keys ``k_idx``, ``k_pos`` with ``k_ok`` (constant true with ``even_keys``: the kernel takes EVEN_K)."""
    return (
        "HKV = HQ // GROUP\nb = pid_bh // HKV\nhk = pid_bh % HKV\n"
        + kv_length(kernel)
        + key_rows(kernel, "pid_n * BLOCK_N", even_keys)
    )


def block_range(
    kernel: LoweredProgram,
    facts: str,
    full_facts: str,
    block: str,
    count: str,
    offset: str,
    placeholders: dict[str, str],
    window: tuple[str, str] | None = None,
    floor_last: bool = False,
) -> str:
    """Loop bounds over index space [0, count): ``start``, ``full_start``, ``full_end``, ``hi``.

    Blocks in [start, full_start) and [full_end, hi) need the mask; [full_start, full_end) are kept whole.
    The masks' facts are positions; an index is its position minus ``offset``. ``window``: (lo, hi) indices
    this program is limited to (a split of the keys), block-aligned. ``floor_last``: the first index clamped
    to count, then to 0 (the same value, count being at least 0; where lo is 0 the compiler then folds start to
    0: the forward template at head dim 256, whose workers ptxas otherwise read start from local memory).
    """
    lines = ["lo = 0", f"hi = {count}", "full_lo = 0", f"full_hi = {count}"]
    for m in kernel.masks:
        f = m.fragment
        if getattr(f, facts) is not None:
            lo, hi = (m.code(e, **placeholders) for e in getattr(f, facts))
            lines += [f"lo = tl.maximum(lo, {lo} - {offset})  # {m.prefix}", f"hi = tl.minimum(hi, {hi} - {offset})"]
        if getattr(f, full_facts) is not None:
            lo, hi = (m.code(e, **placeholders) for e in getattr(f, full_facts))
            lines += [
                f"full_lo = tl.maximum(full_lo, {lo} - {offset})  # {m.prefix}",
                f"full_hi = tl.minimum(full_hi, {hi} - {offset})",
            ]
        elif f.keep is not None:
            lines.append(f"full_hi = 0  # {m.prefix} gives no full blocks")
    narrow = ".to(tl.int32)" if kernel.config.wide_positions else ""  # int64 facts, clamped to [0, count]
    lines += [
        f"lo = tl.maximum(tl.minimum(lo, {count}), 0){narrow}"
        if floor_last
        else f"lo = tl.minimum(tl.maximum(lo, 0), {count}){narrow}",
        f"hi = tl.maximum(tl.minimum(hi, {count}), lo){narrow}",
    ]
    if window is not None:  # starts block-aligned, so no block is visited by two programs
        lines += [
            f"w_lo = {window[0]}  # this program's split",
            f"w_hi = tl.maximum({window[1]}, w_lo)",
            "lo = tl.minimum(tl.maximum(lo, w_lo), w_hi)",
            "hi = tl.maximum(tl.minimum(hi, w_hi), lo)",
        ]
    lines += [
        f"full_lo = tl.minimum(tl.maximum(full_lo, lo), hi){narrow}",
        f"full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo){narrow}",
        f"start = lo // {block} * {block}",
        f"full_start = tl.minimum((full_lo + {block} - 1) // {block} * {block}, hi)",
        f"full_end = tl.maximum(tl.minimum(full_hi // {block} * {block}, {count} // {block} * {block}), full_start)",
    ]
    return "\n".join(lines) + "\n"


def key_range(kernel: LoweredProgram, window: tuple[str, str] | None = None, floor_last: bool = False) -> str:
    """Forward, dQ and decode: which key blocks a query block (positions q_lo .. q_hi) visits, within
    ``window`` (a decode program's split) when given (``floor_last``: ``block_range``'s)."""
    count = key_count(kernel)
    if not has_masks(kernel) and window is None:
        return f"start = 0\nhi = {count}\nfull_start = 0\nfull_end = {count} // BLOCK_N * BLOCK_N\n"
    return block_range(
        kernel,
        "kv_range",
        "full_range",
        "BLOCK_N",
        count,
        key_shift(kernel),
        {"q_lo": "q_lo", "q_hi": "q_hi"},
        window,
        floor_last,
    )


def listing_mask(kernel: LoweredProgram):
    """The mask that lists the blocks it keeps anything in (block sparsity), if the program has one."""
    return next((m for m in kernel.masks if m.fragment.block_list is not None), None)


def visit(
    kernel: LoweredProgram,
    body,
    var: str,
    block: str,
    block_start: str,
    transposed: bool = False,
    group_setup: str | None = None,
) -> str:
    """The loops over key blocks (query blocks, ``transposed``, for dK/dV); ``body(masked, implied)`` gives
    a loop body. With a listing mask: one flat loop over the tiles of its listed blocks (flat, so Triton
    pipelines the loads across blocks), skipping tiles outside [start, hi) when other masks bound the
    range; otherwise ``loops``. ``group_setup``: per query head ``g`` of a kv head's group (dK/dV), the
    code that points the loop at that head's rows: the loops then visit every head's blocks."""
    m = listing_mask(kernel)
    split = transposed and split_heads(kernel) is not None
    if m is None:
        head = has_masks(kernel) if transposed else masked_head(kernel.masks)
        return loops(lambda masked: body(masked, None), var, block, head, group_setup, split)
    heads = "g_lo, g_hi" if split else "GROUP"
    bl = m.fragment.block_list
    count = m.code(bl.q_count if transposed else bl.count, block="list_block")
    index = m.code(bl.q_index if transposed else bl.index, block="list_block", i="list_t // list_tiles")
    tile = body(True, m.prefix)
    partial = bl.q_partial if transposed else bl.partial
    if partial is not None:  # read by ``scores``: whether the listing mask's keep applies in this block
        tile = f"list_partial = {m.code(partial, block='list_block', i='list_t // list_tiles')}\n{tile}"
    if any(other.fragment.kv_range is not None for other in kernel.masks if other is not m):
        tile = f"if ({var} + {block} > start) & ({var} < hi):\n{indent(tile, 4)}"
    code = (
        f"# {m.prefix}: visit only the blocks it lists, tile by tile\nlist_size = {m.code(bl.size)}\n"
        f"list_tiles = list_size // {block}\nlist_block = ({block_start}) // list_size\n"
        f"for list_t in range(0, {count} * list_tiles):\n"
        f"    {var} = {index} * list_size + list_t % list_tiles * {block}\n{indent(tile, 4)}"
    )
    if group_setup is None:
        return code
    # the lists differ from head to head: one flat loop per head
    return f"for g in range({heads}):\n{indent(group_setup, 4)}{indent(code, 4)}"


def loops(body, var: str, block: str, has_head: bool, group_setup: str | None = None, split: bool = False) -> str:
    """The masked head, unmasked middle and masked tail loops; ``body(masked)`` gives a loop body.

    With ``group_setup``, each loop steps through (query head g of the group, block) pairs in one flat
    loop: Triton pipelines it across heads, and a loop nest (per head, then per block) would keep about
    twice the registers live and spill. ``split``: only heads ``g_lo`` .. ``g_hi`` (see ``program``)."""
    # the loop's head: the step's index i among the program's heads, and the head g. Never t // 0 (a loop of no
    # steps): a division by 0 is undefined, and the software pipeline's prologue computes the first step's
    # addresses before the bound stops the loop; with it, an H100 read outside q in a packed float32 dK/dV kernel
    per_head = "t // tl.maximum(steps, 1)"
    heads, i, head = (
        ("(g_hi - g_lo)", "i", f"i = {per_head}\ng = g_lo + i\n") if split else ("GROUP", "g", f"g = {per_head}\n")
    )

    def loop(comment: str, lo: str, hi: str, masked: bool) -> str:
        if group_setup is None:
            return f"# {comment}\nfor {var} in range({lo}, {hi}, {block}):\n{indent(body(masked), 4)}"
        return (
            f"# {comment}, for each query head of the group\nsteps = ({hi} - {lo} + {block} - 1) // {block}\n"
            f"for t in range(0, {heads} * steps):\n{indent(head, 4)}"
            f"    {var} = {lo} + (t - {i} * steps) * {block}\n"
            f"{indent(group_setup, 4)}{indent(body(masked), 4)}"
        )

    parts = [loop("masked head", "start", "full_start", True)] if has_head else []
    parts.append(loop("full blocks: no mask arithmetic", "full_start", "full_end", False))
    parts.append(loop("masked tail", "full_end", "hi", True))
    return "\n".join(parts)


def every_block(body, var: str, block: str) -> str:
    """One loop over every block in [start, hi), each as a masked one (``body(True)``): less code than
    ``loops``, for a rarely taken path."""
    return f"for {var} in range(start, hi, {block}):\n{indent(body(True), 4)}"
