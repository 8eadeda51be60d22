"""``context_parallel``: one attention program over a sequence split across the ranks of a process group.

Each rank holds its shard of q, k and v (``layout.shard``). The K/V shards travel around a ring (``ring.py``)
while each rank runs the program's kernels on its query chunks against the key chunks at hand, at their
global positions (``q_offset``, ``k_offset``, ``seq_len``: one compiled kernel serves every chunk pair).
Results over the chunks of keys merge by the normaliser's combine rule (``merge.py``). The backward runs
the backward kernels on the same pairs, with the rows' global out and lse; dK and dV accumulate (in
float32) while they travel the ring back to their owners, so no gradient is accumulated with atomics and
every sum has a fixed order.
"""

from __future__ import annotations

import itertools
from typing import Any

import attrs
import torch

from ..errors import InputError, UnsupportedError
from ..lru import LRUCache
from ..plan import Plan
from ..program import RESERVED_ARGUMENTS, AttentionProgram
from ..runtime.autograd import _FirstOrderOnly
from ..runtime.compiled import compiled
from ..runtime.dropout import check_dropout_p
from ..runtime.hoisted import HoistedForward
from ..runtime.fp8 import FP8_ARGUMENTS, is_fp8
from ..runtime.fp8 import refuse as refuse_fp8
from ..runtime.inputs import Positions, accumulator_dtype, check_inputs, kv_cache
from ..runtime.launch import keeps_lse, planned
from .agree import Facts, agree
from .layout import (
    check_chunks,
    check_dim,
    check_layout,
    check_shard_layout,
    chunk_count,
    gather,
    group_of,
    rank_chunks,
    with_layout,
)
from .merge import merge, nothing
from .pairs import RingProgram, check_takes_offsets, keeps_any, ring_program
from .ring import Ring

MAX_PROGRAMS = 64  # graphs whose ring checks are kept (a program's traces: one per static setting)


def context_parallel(
    program: AttentionProgram, group: Any = None, layout: str = "zigzag", sharded: dict[str, int] | None = None
) -> ContextParallel:
    """``program`` over a sequence split across the ranks of ``group`` (None: the default group).

    The result is called like the program, on each rank with its shards of q (B, Hq, N/W, D), k and v
    (B, Hkv, N/W, D/DV) (``attnfuse.distributed.shard`` with the same ``layout``), and returns the rank's
    shard of out (B, Hq, N/W, DV), or (out, lse) with ``return_lse=True``: equal to the program on the whole
    sequence, forward and backward. Every rank must call it (it communicates).

    :param layout: ``"zigzag"`` (rank r holds chunks r and 2W-1-r of 2W: balanced under a causal mask) or
        ``"contiguous"`` (chunk r of W: for programs without a causal mask).
    :param sharded: the runtime inputs given as this rank's shards, by argument name, with the dim that
        holds their sequence (RoPE tables (N, D): ``{"cos": 0, "sin": 0}``); they are gathered once per call.
        Other runtime inputs are passed whole, the same on every rank (indexed by position, or per head).
    """
    return ContextParallel(program, group, layout, sharded)


class ContextParallel:
    """A program split over the ranks of a group (see ``context_parallel``)."""

    def __init__(self, program: AttentionProgram, group: Any, layout: str, sharded: dict[str, int] | None):
        if not isinstance(program, AttentionProgram):
            raise InputError(
                f"context_parallel: program must be an @af.attention program, got {type(program).__name__}"
            )
        self.program = program
        self.layout = check_layout(layout)
        group, rank, world = group_of(group)
        if world == 1:
            raise InputError(
                "context_parallel: the group has one rank, so there is nothing to split; call the program itself"
            )
        self.ring = Ring(group, rank, world)
        self._programs: LRUCache[Any, RingProgram] = LRUCache(MAX_PROGRAMS)
        self._takes_offsets: LRUCache[Any, Any] = LRUCache(MAX_PROGRAMS)  # graphs checked by check_takes_offsets
        self.sharded = dict(sharded or {})
        for name, dim in self.sharded.items():
            if not isinstance(dim, int) or isinstance(dim, bool):
                raise InputError(
                    f"context_parallel: sharded[{name!r}] must be the int dim of its sequence, got {dim!r}"
                )

    def ring_program(self, plan: Plan) -> RingProgram:
        """The ring's view of the program ``plan`` runs (checked once per graph)."""
        return self._programs.get_or_build(plan.graph, lambda: ring_program(plan))

    def __call__(self, *args: Any, return_lse: bool = False, **kwargs: Any):
        """out (B, Hq, N/W, DV) of this rank's rows, or (out, lse) with lse (B, Hq, N/W) float32.

        Every rank checks its own call first, then one small all-gather tells every rank whether all calls
        are good and alike (``agree``): a bad call on one rank raises on every rank, before any collective
        that would wait for it."""
        ring = self.ring
        try:
            graph, (q, k, v), inputs, facts = self._checked(args, kwargs, return_lse)
            failure = None
        except Exception as exc:  # every rank must hear of it, whatever it is
            facts, failure = None, exc
        agree(
            ring.group,
            ring.world,
            facts,
            failure,
            "context_parallel",
            "every rank must give shards of equal size (attnfuse.distributed.shard gives each rank N / W rows of "
            "the sequence) and the same other arguments",
        )
        for name, dim in self.sharded.items():
            inputs[name] = gather(inputs[name], ring.group, self.layout, dim)
        call = _Call(self, graph, inputs, q, k, v, return_lse)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            out, lse = _RingAttention.apply(call, q, k, v)
        else:
            out, lse = call.forward(q, k, v)
        with_layout(out, self.layout)
        return (out, with_layout(lse, self.layout)) if return_lse else out

    def _checked(self, args: tuple, kwargs: dict, return_lse: bool) -> tuple[Any, tuple, dict[str, Any], Facts]:
        """This rank's call, checked without other ranks: (graph, (q, k, v), runtime inputs, the facts every
        rank's call must share)."""
        if check_dropout_p(kwargs.get("dropout_p", 0.0)) > 0.0:
            raise UnsupportedError(
                "context_parallel: dropout_p > 0 is not supported by the ring yet; call it with dropout_p=0"
            )
        kwargs = {name: value for name, value in kwargs.items() if name != "dropout_p"}
        refused = [name for name in RESERVED_ARGUMENTS if name in kwargs]
        packed = [name for name in refused if name.startswith(("cu_seqlens", "max_seqlen"))]
        fp8 = [name for name in refused if name in FP8_ARGUMENTS]
        if fp8:
            refuse_fp8(f"context_parallel's ring ({', '.join(fp8)})")
        if packed:
            raise UnsupportedError(
                f"context_parallel: packed sequences ({', '.join(packed)}) are not supported by the ring yet: "
                f"call the program itself with them, or the ring on one unpacked sequence"
            )
        if refused:
            cache = (
                "; kv_lens and block_table describe a decoding cache, which needs no ring: call the program "
                "itself on it"
                if {"kv_lens", "block_table", "validate"} & set(refused)
                else ""
            )
            raise InputError(
                f"context_parallel: the ring takes no {' or '.join(refused)}: it splits one whole "
                f"sequence (q, k and v shards of the same length) and sets every chunk's positions "
                f"itself{cache}"
            )
        (q, k, v), args, kwargs = self.program._take_qkv(args, kwargs)
        statics, inputs = self.program._bind(args, kwargs)
        graph = self.program._trace(statics)
        self._takes_offsets.get_or_build(graph, lambda: check_takes_offsets(graph))
        check_inputs(q, k, v)
        if is_fp8(q):
            refuse_fp8("context_parallel's ring")
        n = q.shape[2]
        if k.shape[2] != n or v.shape[2] != n:
            raise InputError(
                f"context_parallel: q, k and v shards must have the same length, got {n}, {k.shape[2]} and {v.shape[2]}"
            )
        per_rank = len(rank_chunks(self.layout, self.ring.rank, self.ring.world))
        if n % per_rank:
            raise InputError(
                f"context_parallel: a shard of {n} rows cannot hold {per_rank} equal chunks (layout "
                f"{self.layout!r}): the sequence length must be a multiple of "
                f"{chunk_count(self.layout, self.ring.world)}"
            )
        for name, t in (("q", q), ("k", k), ("v", v)):
            check_shard_layout(t, self.layout, "context_parallel", name)
        for name, dim in self.sharded.items():
            if name not in inputs:
                raise InputError(
                    f"context_parallel: sharded names {name!r}, which is not a runtime input of this "
                    f"call ({', '.join(inputs) or 'none'})"
                )
            if not isinstance(inputs[name], torch.Tensor):
                raise InputError(
                    f"context_parallel: sharded names {name!r}, a {type(inputs[name]).__name__}: only "
                    f"tensors can be given as shards"
                )
            check_dim(inputs[name], dim, f"context_parallel: sharded[{name!r}]", name)
            check_chunks(inputs[name], dim, self.layout, self.ring.rank, self.ring.world, f"context_parallel: {name}")
            check_shard_layout(inputs[name], self.layout, "context_parallel", name)
        wanted = [name for name, t in inputs.items() if isinstance(t, torch.Tensor) and t.requires_grad]
        if wanted:
            raise InputError(
                f"context_parallel: runtime inputs {wanted} require grad, which a ring does not "
                f"compute; pass them detached"
            )
        facts = {
            "q's shape": list(q.shape),
            "k's shape": list(k.shape),
            "v's shape": list(v.shape),
            "the dtype": str(q.dtype),
            "the static arguments": repr(statics),
            "return_lse": return_lse,
            "the gradients wanted": torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
            "the layout": self.layout,
            "sharded": sorted(self.sharded.items()),
            **{
                f"{name}'s shape and dtype": [list(t.shape), str(t.dtype)]
                if isinstance(t, torch.Tensor)
                else type(t).__name__
                for name, t in inputs.items()
            },
        }
        return graph, (q, k, v), inputs, facts


class _Call:
    """One call's ring: its program, inputs and chunk geometry, the kernels of its chunk pairs, the pairs
    the masks keep anything in, and the forward and backward loops."""

    def __init__(
        self,
        cp: ContextParallel,
        graph: Any,
        inputs: dict[str, Any],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        return_lse: bool,
    ):
        ring = self.ring = cp.ring
        self.inputs = inputs
        self.q_chunks = rank_chunks(cp.layout, ring.rank, ring.world)
        self.owners = [rank_chunks(cp.layout, r, ring.world) for r in range(ring.world)]
        self.size = q.shape[2] // len(self.q_chunks)  # rows of a chunk
        self.seq_len = self.size * chunk_count(cp.layout, ring.world)
        self.dtype = accumulator_dtype(q.dtype)
        wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        rows = self._rows(q, 0)
        kv = self._kv(k.contiguous(), v.contiguous(), 0, 0, 0)  # as the ring passes them on
        call = planned(
            graph,
            rows,
            kv.k,
            kv.v,
            inputs,
            None,
            None,
            return_lse=keeps_lse(graph, return_lse),
            grads=() if wants_grad else None,
            split_kv=False,
            positions=kv.positions,
        )
        self.program = cp.ring_program(call.compiled.plan)
        self.forward_kernel, self.call = call.forward, call  # its backward generated when first run
        self.partial_kernel = None
        if self.program.partial:  # every row's result counts the normaliser's key-independent term once
            kernels = compiled(graph, attrs.evolve(call.compiled.config, partial=True))
            self.partial_kernel = kernels.hoisted if isinstance(call.forward, HoistedForward) else kernels.forward
        self._kept: dict[tuple[int, int], bool] = {}
        self._names = {"Nk": self.seq_len, "HQ": q.shape[1], "GROUP": q.shape[1] // k.shape[1]}

    def _rows(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """Chunk ``i`` (in this shard's order) of a shard (B, H, N/W, ...) or of its lse (B, H, N/W)."""
        return x.narrow(2, i * self.size, self.size)

    def _kv(self, k: torch.Tensor, v: torch.Tensor, j: int, q_chunk: int, k_chunk: int):
        """The KV view of key chunk ``j`` of a K/V shard, against query chunk ``q_chunk``, at their positions."""
        positions = Positions(q_chunk * self.size, k_chunk * self.size, self.seq_len)
        return kv_cache(self._rows(k, j), self._rows(v, j), None, None, positions)

    def _pairs(self, step: int):
        """(query slot, query chunk, key slot, key chunk) of a step: the keys of rank (rank - step)'s shard."""
        owner = self.owners[(self.ring.rank - step) % self.ring.world]
        return itertools.product(enumerate(self.q_chunks), enumerate(owner))

    def _keeps(self, q_chunk: int, k_chunk: int) -> bool:
        """Whether some query of ``q_chunk`` may keep some key of ``k_chunk`` (the masks' facts)."""
        key = (q_chunk, k_chunk)
        if key not in self._kept:
            s = self.size
            self._kept[key] = keeps_any(
                self.program.masks,
                range(q_chunk * s, q_chunk * s + s),
                range(k_chunk * s, k_chunk * s + s),
                self._names,
            )
        return self._kept[key]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This shard's out (B, Hq, N/W, DV) in q's dtype and lse (B, Hq, N/W) (None for a "sum" normaliser).
        With a ``partial`` normaliser fragment, each query chunk's pair with its own key chunk (step 0) runs
        the whole fragment, launched even if its mask keeps nothing there, and every other pair the partial."""
        combine = self.program.combine
        totals: list = [None] * len(self.q_chunks)
        kv = (k.contiguous(), v.contiguous())
        for step in range(self.ring.world):
            transfer = self.ring.pass_on(kv) if step + 1 < self.ring.world else None
            for (i, qc), (j, kc) in self._pairs(step):
                counts_term = step == 0 and qc == kc  # with a partial fragment: the one pair that runs the whole
                if not (self._keeps(qc, kc) or (counts_term and self.partial_kernel is not None)):
                    continue
                kernel = self.forward_kernel if counts_term or self.partial_kernel is None else self.partial_kernel
                part = kernel(self._rows(q, i), self._kv(*kv, j, qc, kc), self.inputs)
                totals[i] = merge(totals[i], part, combine, self.dtype)
            if transfer is not None:
                kv = transfer.wait()
        out = q.new_empty((*q.shape[:3], v.shape[3]))
        lse = q.new_empty(q.shape[:3], dtype=self.dtype) if combine == "logsumexp" else None
        for i, total in enumerate(totals):
            chunk_out, chunk_lse = total or nothing(
                (*q.shape[:2], self.size), v.shape[3], combine, self.dtype, q.device
            )
            self._rows(out, i).copy_(chunk_out)
            if lse is not None:
                self._rows(lse, i).copy_(chunk_lse)
        return out, lse

    def backward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        dout: torch.Tensor | None,
        dlse: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dq, dk, dv of this rank's shards, in their dtypes. Each pair runs the backward kernels with its
        rows' global out and lse; dQ sums here, dK and dV in float32 buffers that travel with the keys."""
        dout = torch.zeros_like(out) if dout is None else dout
        dq = torch.zeros(q.shape, dtype=self.dtype, device=q.device)
        dkv = (
            torch.zeros(k.shape, dtype=self.dtype, device=k.device),
            torch.zeros(v.shape, dtype=self.dtype, device=v.device),
        )
        kv = (k.contiguous(), v.contiguous())
        sums = None  # dK, dV on their way from the previous rank
        for step in range(self.ring.world):
            transfer = self.ring.pass_on(kv) if step + 1 < self.ring.world else None
            parts = []
            for (i, qc), (j, kc) in self._pairs(step):
                if not self._keeps(qc, kc):
                    continue
                rows_lse = None if lse is None else self._rows(lse, i).contiguous()
                rows_dlse = None if dlse is None else self._rows(dlse, i).contiguous()
                dq_i, dk_j, dv_j, _ = self.call.backward(
                    self._rows(q, i),
                    self._kv(*kv, j, qc, kc),
                    self._rows(out, i),
                    rows_lse,
                    self._rows(dout, i),
                    rows_dlse,
                    self.inputs,
                )
                self._rows(dq, i).add_(dq_i)
                parts.append((j, dk_j, dv_j))
            if sums is not None:
                dkv = sums.wait()
            for j, dk_j, dv_j in parts:
                self._rows(dkv[0], j).add_(dk_j)
                self._rows(dkv[1], j).add_(dv_j)
            sums = self.ring.pass_on(dkv)
            if transfer is not None:
                kv = transfer.wait()
        dk, dv = sums.wait()  # this rank's own keys' gradients, back from the last rank they visited
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """out, lse = ring(q, k, v); the backward runs the ring's backward. First order only, as a program
    call is."""

    @staticmethod
    def forward(ctx, call: _Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        out, lse = call.forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout: torch.Tensor | None, dlse: torch.Tensor | None):
        q, k, v, out, lse = ctx.saved_tensors

        def gradients() -> tuple[torch.Tensor, ...]:
            return ctx.call.backward(q, k, v, out, lse, dout, dlse)

        if torch.is_grad_enabled():  # create_graph=True: the results must raise if differentiated again
            grads = _FirstOrderOnly.apply(gradients, *(t for t in (q, k, v, dout, dlse) if t is not None))
        else:
            grads = gradients()
        return (None, *grads)
