"""block_sparse(s, block_mask): keep only the (query block, key block) pairs a BlockMask marks active, and
inside its partial blocks only the pairs their token masks keep."""

from __future__ import annotations

import torch

from attnfuse.plugin import (
    BlockList,
    BlockMask,
    Combinator,
    InputError,
    MaskFragment,
    Param,
    Role,
    ScalarArg,
    TensorArg,
    hookimpl,
)


def _check(block_mask, B: int, Hq: int, Nq: int, Nk: int) -> BlockMask:
    if not isinstance(block_mask, BlockMask):
        raise InputError(
            f"block_sparse: block_mask must be an attnfuse BlockMask (af.create_block_mask, "
            f"af.create_block_mask_from_blocks or af.BlockMask.from_blocks), "
            f"got {type(block_mask).__name__}"
        )
    block_mask.check_unchanged()  # a mask is checked when built: unedited, it is still valid
    Bm, Hm = block_mask.active.shape[:2]
    if (block_mask.Nq, block_mask.Nk) != (Nq, Nk) or Bm not in (1, B) or Hm not in (1, Hq):
        raise InputError(
            f"block_sparse: block_mask was built for B={Bm}, H={Hm}, Nq={block_mask.Nq}, "
            f"Nk={block_mask.Nk}; the call has B={B}, Hq={Hq}, Nq={Nq}, Nk={Nk}"
        )
    return block_mask


def _csr(name: str, *indices: str) -> str:
    """Load one entry of a per-(batch, head) CSR tensor: ``$name[b, h, *indices]``."""
    parts = [f"b.to(tl.int64) * ${name}_s0", f"h.to(tl.int64) * ${name}_s1"]
    parts += [f"({index}) * ${name}_s{i + 2}" for i, index in enumerate(indices)]
    return f"tl.load(${name} + {' + '.join(parts)})"


def reference(ctx, block_mask):
    """keep (Bm, Hm, Nq, Nk) from the block grid and the partial blocks' token masks."""
    return _check(block_mask, ctx.B, ctx.Hq, ctx.Nq, ctx.Nk).to_dense().to(ctx.device)


def prepare(ctx, block_mask):
    bm = _check(block_mask, ctx.B, ctx.Hq, ctx.Nq, ctx.Nk)

    def per_head(t: torch.Tensor) -> torch.Tensor:  # broadcast (1 or B, 1 or Hq, ...) to (B, Hq, ...)
        t = t.to(ctx.device)
        return t.expand(ctx.B, ctx.Hq, *t.shape[2:])

    return {
        "active": per_head(bm.active.view(torch.uint8)),
        "kv_num": per_head(bm.kv_num_blocks),
        "kv_idx": per_head(bm.kv_indices),
        "q_num": per_head(bm.q_num_blocks),
        "q_idx": per_head(bm.q_indices),
        "q_order": bm.q_block_order.to(ctx.device),
        "kv_order": bm.kv_block_order.to(ctx.device),
        "partial": per_head(bm.partial_index),
        "token_masks": bm.partial_masks.view(torch.uint8).to(ctx.device),
        "block_size": bm.block_size,
        "kv_heavy": bm.kv_heavy_blocks,
    }


def examples(draw, shape):
    """A random block grid, or a random token mask (with partial blocks) from ``create_block_mask``."""
    import warnings

    from hypothesis import strategies as st

    from attnfuse.plugin import create_block_mask, create_block_mask_from_blocks, random_tensor

    bs = draw(st.sampled_from([16, 32]))
    threshold = draw(st.floats(-1.0, 1.0))
    if draw(st.booleans()):
        scores = random_tensor(draw, shape.B, 1, -(-shape.Nq // bs), -(-shape.Nk // bs))
        mask = create_block_mask_from_blocks(
            lambda b, h, qb, kb: scores[b, h, qb, kb] > threshold, shape.B, None, shape.Nq, shape.Nk, block_size=bs
        )
        return {"block_mask": mask}
    scores = random_tensor(draw, shape.B, 1, shape.Nq, shape.Nk)
    with warnings.catch_warnings():  # create_block_mask's one-release notice of its new meaning
        warnings.simplefilter("ignore", DeprecationWarning)
        mask = create_block_mask(
            lambda b, h, q, k: (scores[b, h, q, k] > threshold) | (q // 3 == k // 5),
            shape.B,
            None,
            shape.Nq,
            shape.Nk,
            block_size=bs,
        )
    return {"block_mask": mask}


def _token_mask() -> str:
    """Whether a partial block's token mask keeps each pair (true in a block with none: kept in full)."""
    tile = (
        "tl.load($partial + b.to(tl.int64) * $partial_s0 + h.to(tl.int64) * $partial_s1"
        " + (q_idx // $block_size)[:, None] * $partial_s2 + (k_idx // $block_size)[None, :] * $partial_s3,"
        " mask=in_bounds, other=-1)"
    )
    return (
        f"(tl.load($token_masks + ({tile}).to(tl.int64) * $token_masks_s0"
        f" + (q_idx % $block_size)[:, None] * $token_masks_s1 + (k_idx % $block_size)[None, :] * $token_masks_s2,"
        f" mask=in_bounds & ({tile} >= 0), other=1) != 0)"
    )


COMBINATOR = Combinator(
    name="block_sparse",
    role=Role.MASK,
    doc="Keep only the blocks a BlockMask (af.create_block_mask) marks active, and inside its partial blocks the "
    "pairs their token masks keep.",
    params=[Param(name="block_mask", runtime=True, doc="an af.BlockMask for these B, H, Nq, Nk")],
    reference=reference,
    tensors=[
        TensorArg(name="active", rank=4),
        TensorArg(name="kv_num", rank=3),
        TensorArg(name="kv_idx", rank=4),
        TensorArg(name="q_num", rank=3),
        TensorArg(name="q_idx", rank=4),
        TensorArg(name="q_order", rank=1),
        TensorArg(name="kv_order", rank=1),
        TensorArg(name="partial", rank=4),
        TensorArg(name="token_masks", rank=3),
    ],
    scalars=[ScalarArg(name="block_size"), ScalarArg(name="kv_heavy")],
    prepare=prepare,
    fragment=MaskFragment(
        keep="""(tl.load($active + b.to(tl.int64) * $active_s0 + h.to(tl.int64) * $active_s1
                         + (q_idx // $block_size)[:, None] * $active_s2 + (k_idx // $block_size)[None, :] * $active_s3,
                         mask=in_bounds, other=0) != 0) & """
        + _token_mask(),
        block_list=BlockList(
            size="$block_size",
            count=_csr("kv_num", "$$block"),
            index=_csr("kv_idx", "$$block", "$$i"),
            q_count=_csr("q_num", "$$block"),
            q_index=_csr("q_idx", "$$block", "$$i"),
            order="tl.load($q_order + ($$slot) * $q_order_s0)",
            q_order="tl.load($kv_order + ($$slot) * $kv_order_s0)",
            q_split="$kv_heavy",
            partial=_csr("partial", "$$block", _csr("kv_idx", "$$block", "$$i")) + " >= 0",
            q_partial=_csr("partial", _csr("q_idx", "$$block", "$$i"), "$$block") + " >= 0",
        ),
    ),
    examples=examples,
    packed_rows=True,
    takes_offsets=True,
)


@hookimpl
def attnfuse_combinators():
    return [COMBINATOR]
