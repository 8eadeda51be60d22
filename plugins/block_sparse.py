"""block_sparse(s, block_mask): keep only the (query block, key block) pairs a BlockMask marks active."""
from __future__ import annotations

import torch

from attnfuse.block_mask import BlockMask
from attnfuse.combinator import BlockList, Combinator, MaskFragment, Param, Role, ScalarArg, TensorArg
from attnfuse.errors import InputError
from attnfuse.hookspecs import hookimpl


def _check(block_mask, B: int, Hq: int, Nq: int, Nk: int) -> BlockMask:
    if not isinstance(block_mask, BlockMask):
        raise InputError(f"block_sparse: block_mask must be an attnfuse BlockMask (af.create_block_mask), "
                         f"got {type(block_mask).__name__}")
    block_mask.check_unchanged()  # a mask is checked when built: unedited, it is still valid
    Bm, Hm = block_mask.active.shape[:2]
    if (block_mask.Nq, block_mask.Nk) != (Nq, Nk) or Bm not in (1, B) or Hm not in (1, Hq):
        raise InputError(f"block_sparse: block_mask was built for B={Bm}, H={Hm}, Nq={block_mask.Nq}, "
                         f"Nk={block_mask.Nk}; the call has B={B}, Hq={Hq}, Nq={Nq}, Nk={Nk}")
    return block_mask


def _csr(name: str, *indices: str) -> str:
    """Load one entry of a per-(batch, head) CSR tensor: ``$name[b, h, *indices]``."""
    parts = [f"b.to(tl.int64) * ${name}_s0", f"h.to(tl.int64) * ${name}_s1"]
    parts += [f"({index}) * ${name}_s{i + 2}" for i, index in enumerate(indices)]
    return f"tl.load(${name} + {' + '.join(parts)})"


def reference(ctx, block_mask):
    """keep (Bm, Hm, Nq, Nk) from the block grid."""
    return _check(block_mask, ctx.B, ctx.Hq, ctx.Nq, ctx.Nk).to_dense().to(ctx.device)


def prepare(ctx, block_mask):
    bm = _check(block_mask, ctx.B, ctx.Hq, ctx.Nq, ctx.Nk)

    def per_head(t: torch.Tensor) -> torch.Tensor:  # broadcast (1 or B, 1 or Hq, ...) to (B, Hq, ...)
        t = t.to(ctx.device)
        return t.expand(ctx.B, ctx.Hq, *t.shape[2:])
    return {"active": per_head(bm.active.view(torch.uint8)), "kv_num": per_head(bm.kv_num_blocks),
            "kv_idx": per_head(bm.kv_indices), "q_num": per_head(bm.q_num_blocks), "q_idx": per_head(bm.q_indices),
            "q_order": bm.q_block_order.to(ctx.device), "kv_order": bm.kv_block_order.to(ctx.device),
            "block_size": bm.block_size, "kv_heavy": bm.kv_heavy_blocks}


def examples(draw, shape):
    from hypothesis import strategies as st

    from attnfuse.block_mask import create_block_mask
    from attnfuse.examples_support import random_tensor

    bs = draw(st.sampled_from([16, 32]))
    scores = random_tensor(draw, shape.B, 1, -(-shape.Nq // bs), -(-shape.Nk // bs))
    threshold = draw(st.floats(-1.0, 1.0))
    mask = create_block_mask(lambda b, h, qb, kb: scores[b, h, qb, kb] > threshold,
                             shape.B, None, shape.Nq, shape.Nk, block_size=bs)
    return {"block_mask": mask}


COMBINATOR = Combinator(
    name="block_sparse",
    role=Role.MASK,
    doc="Keep only the blocks a BlockMask (af.create_block_mask) marks active.",
    params=[Param(name="block_mask", runtime=True, doc="an af.BlockMask for these B, H, Nq, Nk")],
    reference=reference,
    tensors=[TensorArg(name="active", rank=4), TensorArg(name="kv_num", rank=3), TensorArg(name="kv_idx", rank=4),
             TensorArg(name="q_num", rank=3), TensorArg(name="q_idx", rank=4), TensorArg(name="q_order", rank=1),
             TensorArg(name="kv_order", rank=1)],
    scalars=[ScalarArg(name="block_size"), ScalarArg(name="kv_heavy")],
    prepare=prepare,
    fragment=MaskFragment(
        keep="""(tl.load($active + b.to(tl.int64) * $active_s0 + h.to(tl.int64) * $active_s1
                         + (q_idx // $block_size)[:, None] * $active_s2 + (k_idx // $block_size)[None, :] * $active_s3,
                         mask=in_bounds, other=0) != 0)""",
        block_list=BlockList(
            size="$block_size",
            count=_csr("kv_num", "$$block"),
            index=_csr("kv_idx", "$$block", "$$i"),
            q_count=_csr("q_num", "$$block"),
            q_index=_csr("q_idx", "$$block", "$$i"),
            order="tl.load($q_order + ($$slot) * $q_order_s0)",
            q_order="tl.load($kv_order + ($$slot) * $kv_order_s0)",
            q_split="$kv_heavy",
        ),
    ),
    examples=examples,
    takes_offsets=True,
)


@hookimpl
def attnfuse_combinators():
    return [COMBINATOR]
