"""The backward launcher: the dQ kernel (which also writes each row's delta), then the dK/dV kernel, then
tensor gradients. On Hopper, for the programs and tensors they serve, each is its template's instance
(``attnfuse/kernels``: the dQ template's, the dK/dV template's) where it is chosen (as the forward's is,
``forward.template_forward``), else the generated kernel."""

from __future__ import annotations

import math
import os
import warnings
from typing import Any, Callable

import attrs
import torch

from ..kernels.capability import block_list_reason
from ..kernels.dq_launch import PackedTemplateDq, TemplateDq
from ..kernels.launch_packed import PackedTemplateDkdv, fits_documents, fits_pack
from ..kernels.launch import TemplateDkdv
from ..kernels.verified import chosen, record_key
from ..plan import InputGradient, Plan
from . import packed
from .inputs import KVCache, accumulator_dtype, empty_like_layout, even_keys, heads_together, kv_launch_args
from .kernel import CompiledKernel
from .plugin_args import PluginArgs, Prepared
from .offsets import rows_fit
from .launcher import block_grid, cdiv, multiprocessors, query_grid

SPLIT_PROGRAMS_PER_SM = 12  # a smaller GQA dK/dV grid splits its key blocks (benchmarks/sweep_tiles.py)
SPLIT_QUERY_ROWS = 512  # of which it splits the blocks this many query rows see
FUSED_DQ_ENV = "ATTNFUSE_FUSED_DQ"


def warn_fused_dq() -> None:
    """``ATTNFUSE_FUSED_DQ`` chose the hand-written Hopper dK/dV kernel's fused dQ, which the dK/dV template
    replaced: a setting has no effect, and says so with a DeprecationWarning."""
    if os.environ.get(FUSED_DQ_ENV, "").strip():
        warnings.warn(
            f"{FUSED_DQ_ENV} has no effect and is deprecated: on Hopper the dK/dV template runs the backward, after "
            "the generated dQ kernel (the hand-written kernel that fused dQ is gone); unset it",
            DeprecationWarning,
            stacklevel=3,
        )


def split_blocks(key_blocks: int, rows: int, group: int, device: torch.device) -> tuple[int, int]:
    """(SPLIT_BLOCKS, SPLIT_ROWS) of a GQA dK/dV launch without a listing mask (``key_blocks`` in each of
    ``rows`` batch x kv head rows): how many of the first key blocks run as one program per query head of
    the group, and how many query rows must see a block for it to split. All blocks when the grid would
    have fewer than SPLIT_PROGRAMS_PER_SM programs per multiprocessor, else none; a block that fewer than
    SPLIT_QUERY_ROWS query rows see (a sliding window's blocks, the last causal ones) runs whole after all:
    summing the shares would cost more than the split saves. Under the interpreter: 8 programs, 64 rows."""
    cuda = device.type == "cuda"
    wanted = SPLIT_PROGRAMS_PER_SM * multiprocessors(device) if cuda else 8
    blocks = key_blocks if group > 1 and key_blocks * rows < wanted else 0
    return blocks, SPLIT_QUERY_ROWS if cuda else 64


def template_dkdv(plan: Plan) -> TemplateDkdv | None:
    """The dK/dV template's instance of ``plan`` where the templates can run it and ``verified.chosen`` chooses
    it (a GPU verified it, or ``ATTNFUSE_TEMPLATES=all``), else None."""
    spec = plan.templates.kernels.get("dkdv")
    if spec is None:
        return None
    key = record_key(spec, plan.config.dtype, plan.config.head_dim)
    if not chosen(key):
        return None
    instance = PackedTemplateDkdv if plan.config.varlen else TemplateDkdv
    return instance(spec, plan.templates.scale, plan.templates.qk_scale, key, plan.has_lse)


def template_dq(plan: Plan) -> TemplateDq | None:
    """The dQ template's instance of ``plan`` where the templates can run it and ``verified.chosen`` chooses it
    (a GPU verified it, or ``ATTNFUSE_TEMPLATES=all``), else None."""
    spec = plan.templates.kernels.get("dq")
    if spec is None:
        return None
    key = record_key(spec, plan.config.dtype, plan.config.head_dim)
    if not chosen(key):
        return None
    instance = PackedTemplateDq if plan.config.varlen else TemplateDq
    return instance(spec, plan.templates.scale, plan.templates.qk_scale, key, plan.has_lse)


def partial_sums(
    kernel: CompiledKernel, grid: Callable[[Any], tuple[int, ...]], head_dim: int, q: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Zeroed (programs, D) buffers, by parameter, of the partial sums of qk transform tensor gradients that
    ``kernel`` writes, a row per program of ``grid`` at the smallest tiles (16 rows) it may launch with."""
    if not kernel.spec.partial_buffers:
        return {}
    programs = math.prod(grid(attrs.evolve(kernel.tiles, block_m=16, block_n=16)))
    return {
        name: torch.zeros((programs, head_dim), dtype=accumulator_dtype(q.dtype), device=q.device)
        for name, _ in kernel.spec.partial_buffers
    }


def add_partial_sums(
    kernel: CompiledKernel, buffers: dict[str, torch.Tensor], inputs: dict[str, Any], grads: dict[str, torch.Tensor]
) -> None:
    """Add each of ``kernel``'s partial-sum buffers (``partial_sums``), summed over its programs, to its
    argument's gradient in ``grads``, in the argument's dtype; one that did not launch (no rows) adds zeros."""
    for name, arg in kernel.spec.partial_buffers:
        buffer = buffers.get(name)
        grad = buffer.sum(0).to(inputs[arg].dtype) if buffer is not None else torch.zeros_like(inputs[arg])
        grads[arg] = grads[arg] + grad if arg in grads else grad


def _sum_to(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Sum a (B, Hq, Nq, Nk) gradient over the dimensions a tensor of ``shape`` was broadcast along."""
    padded = (1,) * (4 - len(shape)) + tuple(shape)
    dims = [i for i in range(4) if padded[i] == 1 and grad.shape[i] != 1]
    return (grad.sum(dim=dims, keepdim=True) if dims else grad).reshape(shape)


class BackwardKernels:
    """The gradient kernels of one program and configuration, writing the tensor gradients asked for.

    ``tensor_grads``: the runtime inputs (of ``plan.input_gradients``) whose gradient the kernels write: a
    score-shaped one (the dQ kernel), summed to its input's shape; a qk transform's (D,) tensor's, from the
    rows of q (the dQ kernel) and k (the dK/dV kernel), as partial sums over each program's rows (none from
    the sides a gradient pass carries back: ``Plan.hoisted_config``'s).
    """

    def __init__(self, plan: Plan, tensor_grads: tuple[InputGradient, ...]):
        self.plan = plan
        self.tensor_grads = tuple(g for g in tensor_grads if not g.sides)  # score-shaped
        interpreted = plan.config.arch == "interpreter"
        dkdv = plan.with_partials("dkdv", tuple(g for g in tensor_grads if g.sides))
        self.dkdv = CompiledKernel(dkdv, interpreted)
        self.dq = CompiledKernel(plan.dq(tensor_grads), interpreted)
        self.plugin_args = PluginArgs(plan)
        self.template = template_dkdv(plan) if not dkdv.partial_buffers else None
        # the dQ template writes no score-shaped gradient of a tensor input, nor transform tensors' partial sums
        self.dq_template = template_dq(plan) if not (self.tensor_grads or self.dq.spec.partial_buffers) else None
        width = dkdv.launch.constants
        self._share_width = (2 * width["BLOCK_H"] if dkdv.halves else width["BLOCK_D"]) + width["BLOCK_DV"]

    def _split_buffers(self, keys: int, group: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scratch of a dK/dV launch that splits heavy key blocks (``keys`` rows in all, over every batch
        and kv head) over the ``group`` query heads: each head's share of dK and dV, in the accumulators'
        precision, and one zeroed counter per key tile (tiles have at least 16 rows). With no ``keys`` the
        kernel reads neither: one-element placeholders, and no fill to launch."""
        dtype = accumulator_dtype(q.dtype)
        if not keys:
            return torch.empty(1, dtype=dtype, device=q.device), torch.empty(1, dtype=torch.int32, device=q.device)
        shares = torch.empty(keys * group * self._share_width, dtype=dtype, device=q.device)
        return shares, torch.zeros(keys // 16, dtype=torch.int32, device=q.device)

    def _generated_dkdv(
        self,
        q: torch.Tensor,
        kv: KVCache,
        dk: torch.Tensor,
        dv: torch.Tensor,
        shared: dict[str, Any],
        pargs: dict[str, Any],
        limit: int | None,
        heavy: int,
        even_m: Any,
        partials: dict[str, dict[str, torch.Tensor]],
    ) -> None:
        """The generated dK/dV kernel's launch, with its split scratch when it splits heavy key blocks; its
        partial-sum buffers go to ``partials["dkdv"]``."""
        B, Hq = q.shape[:2]
        Hkv, Nk = kv.k.shape[1], kv.k.shape[2]
        dkdv_spec = self.dkdv.spec
        split_args = {}
        if dkdv_spec.split_heads:  # heavy key blocks split over a group's query heads
            block_rows = limit or self.dkdv.tiles.block_n
            if not dkdv_spec.scheduled:  # no listing mask: as many of the first blocks as the grid needs
                heavy, split_rows = split_blocks(cdiv(Nk, block_rows), B * Hkv, Hq // Hkv, q.device)
                if kv.packed is not None:  # none of a packed call's: its first blocks are not its heaviest
                    heavy = 0
                split_args.update(SPLIT_BLOCKS=heavy, SPLIT_ROWS=split_rows)
            shares, counts = self._split_buffers(B * Hkv * heavy * block_rows, Hq // Hkv, q)
            split_args.update(PartDKV=shares, SplitCount=counts)
        grid = (
            packed.key_grid(Nk, kv.packed.docs, Hkv)
            if kv.packed is not None
            else block_grid(
                Nk, B * Hkv, "block_n", limit if dkdv_spec.scheduled else None, heavy * (Hq // Hkv - 1), what="B x Hkv"
            )
        )
        buffers = partials["dkdv"] = partial_sums(self.dkdv, grid, q.shape[3], q)
        self.dkdv.launch(
            grid,
            dkdv_spec.launch.bind({**shared, "DKey": dk, "DValue": dv, **pargs, **split_args, **buffers}),
            q.device,
            limit=limit,
            EVEN_K=even_keys(kv),
            EVEN_M=even_m,
        )

    def _generated_dq(
        self,
        q: torch.Tensor,
        kv: KVCache,
        out: torch.Tensor,
        dlse: torch.Tensor | None,
        dq: torch.Tensor,
        shared: dict[str, Any],
        pargs: dict[str, Any],
        limit: int | None,
        even_m: Any,
        buffers: list[torch.Tensor],
        partials: dict[str, dict[str, torch.Tensor]],
    ) -> None:
        """The generated dQ kernel's launch: dq, delta (into ``shared["Delta"]``) and the tensor gradients'
        ``buffers``; its partial-sum buffers go to ``partials["dq"]``."""
        B, Hq, Nq, _ = q.shape
        grad_args = dict(zip(self.dq.spec.grad_buffers, buffers))
        dq_spec = self.dq.spec
        grid = (
            packed.query_grid(Nq, kv.packed.docs, Hq)
            if kv.packed is not None
            else query_grid(Nq, B * Hq, limit if dq_spec.scheduled else None)
        )
        dq_partials = partials["dq"] = partial_sums(self.dq, grid, q.shape[3], q)
        self.dq.launch(
            grid,
            dq_spec.launch.bind(
                {
                    **shared,
                    "O": out,
                    "DLse": shared["Delta"] if dlse is None else dlse,
                    "DQuery": dq,
                    "HEAD_GROUP": heads_together(q, kv),
                    **pargs,
                    **grad_args,
                    **dq_partials,
                }
            ),
            q.device,
            limit=limit,
            HAS_DLSE=dlse is not None,
            EVEN_K=even_keys(kv),
            EVEN_M=even_m,
        )

    def _dq_then_dkdv(
        self,
        q: torch.Tensor,
        kv: KVCache,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        dout: torch.Tensor,
        dlse: torch.Tensor | None,
        dq: torch.Tensor,
        dk: torch.Tensor,
        dv: torch.Tensor,
        inputs: dict[str, Any],
        prepared: Prepared,
        buffers: list[torch.Tensor],
        partials: dict[str, dict[str, torch.Tensor]],
        dq_engine: str,
        engine: str,
    ) -> None:
        """The dQ kernel ``dq_engine`` names, "template" (the dQ template's instance) or "generated" (which also
        writes the tensor gradients' buffers), either writing delta; then the dK/dV kernel ``engine`` names:
        "template" (the dK/dV template's instance) or "generated". Deterministic. The kernels' partial-sum
        buffers (``partial_sums``) go to ``partials`` by kind ("dq", "dkdv")."""
        B, Hq, Nq, _ = q.shape
        delta = torch.empty((B, Hq, Nq), dtype=accumulator_dtype(q.dtype), device=q.device)  # dQ writes it
        shared = {
            "Q": q,
            "K": kv.k,
            "V": kv.v,
            "DO": dout,
            "Lse": delta if lse is None else lse,
            "Delta": delta,
            "HQ": Hq,
            "Nq": Nq,
            **kv_launch_args(kv),
        }  # Lse: a placeholder when the normaliser saves none
        pargs, limit, heavy = prepared
        even_m = False if kv.packed is not None else lambda tiles: Nq % tiles.block_m == 0  # noqa: E731
        launch_args = {**pargs, **kv_launch_args(kv)}  # the templates': the plugins', the cache's, dropout's
        if dq_engine == "template":
            self.dq_template(q, kv.k, kv.v, out, dout, lse, dlse, delta, dq, launch_args)
        else:
            self._generated_dq(q, kv, out, dlse, dq, shared, pargs, limit, even_m, buffers, partials)
        if engine == "template":
            self.template(q, kv.k, kv.v, dout, lse, delta, dk, dv, launch_args)
        else:
            self._generated_dkdv(q, kv, dk, dv, shared, pargs, limit, heavy, even_m, partials)

    def __call__(
        self,
        q: torch.Tensor,
        kv: KVCache,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        dout: torch.Tensor | None,
        dlse: torch.Tensor | None,
        inputs: dict[str, Any],
        dqk_dtype: torch.dtype | None = None,
        prepared: Prepared | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """dq, dk, dv in the inputs' dtypes (dq and dk in ``dqk_dtype`` if given) and memory orders, and the
        gradients of tensor inputs by name. ``prepared``: the plugin arguments, if the caller has them."""
        k, v = kv.k, kv.v
        B, Hq, Nq, D = q.shape
        Nk, DV = k.shape[2], v.shape[3]
        if dout is None:
            dout = torch.zeros_like(out)
        elif not (self.plan.config.wide_offsets or rows_fit(dout)):  # a view the int32 kernels cannot address
            dout = torch.empty_like(out).copy_(dout)
        dq, dk = empty_like_layout(q, D, dqk_dtype or q.dtype), empty_like_layout(k, D, dqk_dtype or k.dtype)
        dv = empty_like_layout(v, DV, v.dtype)
        buffers = [
            torch.zeros((B, Hq, Nq, Nk), dtype=accumulator_dtype(q.dtype), device=q.device) for _ in self.tensor_grads
        ]
        warn_fused_dq()
        partials: dict[str, dict[str, torch.Tensor]] = {}
        if q.numel() and k.numel():
            dlse = dlse.to(accumulator_dtype(q.dtype)).contiguous() if dlse is not None else None
            prepared = prepared or self.plugin_args(q, kv, inputs)
            follows = block_list_reason(prepared.limit) is None  # a listing mask's block size the templates take
            served = (
                follows
                and self.template is not None
                and self.template.fits(q, k, v, dout, lse, dk, dv)
                and (kv.packed is None or fits_documents(Hq, Nq, Nk, kv.packed.docs))
            )
            engine = "template" if served else "generated"
            dq_served = (
                follows
                and self.dq_template is not None
                and self.dq_template.fits(q, k, v, out, dout, lse, dq)
                and (kv.packed is None or fits_pack(Nq, kv.packed.docs))
            )
            dq_engine = "template" if dq_served else "generated"
            self._dq_then_dkdv(
                q, kv, out, lse, dout, dlse, dq, dk, dv, inputs, prepared, buffers, partials, dq_engine, engine
            )
        else:
            for g in (dq, dk, dv):
                g.zero_()
        grads: dict[str, torch.Tensor] = {}
        for gradient, buffer in zip(self.tensor_grads, buffers):
            arg = gradient.argument
            grad = _sum_to(buffer, inputs[arg].shape).to(inputs[arg].dtype)
            grads[arg] = grads[arg] + grad if arg in grads else grad
        for kind in ("dq", "dkdv"):
            add_partial_sums(getattr(self, kind), partials.get(kind, {}), inputs, grads)
        return dq, dk, dv, grads
