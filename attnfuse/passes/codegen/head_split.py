"""The dK/dV kernel's split of key blocks over a GQA group's query heads (see ``loops.program`` for which
programs take one head): the blocks that stay whole after all, and the sum of the heads' shares."""

from __future__ import annotations

from ..lower import LoweredProgram
from .common import split


# After the block ranges, before the loops (a block's query rows are hi - start)
LIGHT_BLOCKS = """\
# a split key block that fewer than SPLIT_ROWS query rows see runs whole in its group's first program
light = one_head & (hi - start < SPLIT_ROWS)
if light & (g_lo > 0):
    return
one_head = one_head & (hi - start >= SPLIT_ROWS)
g_lo = tl.where(light, 0, g_lo)
g_hi = tl.where(light, GROUP, g_hi)
"""


def share_sum(kernel: LoweredProgram) -> str:
    """After the loops of a dK/dV kernel that splits heavy key blocks over a group's query heads: a
    one-head program stores its share of the accumulators in PartDKV and counts it in SplitCount; the
    group's last to finish sums the shares, in head order, and is the one (``last``) that stores."""
    halves = [("dk1", "BLOCK_H", "dh"), ("dk2", "BLOCK_H", "dh")] if split(kernel) else [("dk", "BLOCK_D", "d")]
    accs = [*halves, ("dv_acc", "BLOCK_DV", "dv")]
    part = f"BLOCK_N * ({' + '.join(width for _, width, _ in accs)})"
    offsets = ["0"] + [f"BLOCK_N * ({' + '.join(w for _, w, _ in accs[:i])})" for i in range(1, len(accs))]

    def at(share: str, i: int) -> str:
        name, width, col = accs[i]
        return f"PartDKV + ({share}) * ({part}) + {offsets[i]} + rows_n[:, None] * {width} + {col}[None, :]"

    stores = "".join(f"    tl.store({at('share + g_lo', i)}, {name})\n" for i, (name, _, _) in enumerate(accs))
    zeros = "".join(
        f"        {name} = tl.zeros([BLOCK_N, {width}], dtype={kernel.accumulator})\n" for name, width, _ in accs
    )
    sums = "".join(
        f'            {name} += tl.load({at("share + j", i)}, cache_modifier=".cg")\n'
        for i, (name, _, _) in enumerate(accs)
    )
    return (
        "last = pid_n >= 0\nif one_head:  # this head's share of a heavy key block\n"
        "    share = (pid_bh * split_slots + slot).to(tl.int64) * GROUP\n    rows_n = tl.arange(0, BLOCK_N)\n"
        + stores
        + "    tl.debug_barrier()  # every thread's stores before the count that publishes them\n"
        "    count = tl.atomic_add(SplitCount + pid_bh * split_slots + slot, 1)\n"
        "    last = count == GROUP - 1\n    if last:  # the group's last share: sum them all, in head order\n"
        "        tl.store(SplitCount + pid_bh * split_slots + slot, 0)  # zero again for the next launch\n"
        + zeros
        + "        for j in range(GROUP):\n"
        + sums
    )
