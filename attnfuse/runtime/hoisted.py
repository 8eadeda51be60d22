"""Hoisted qk transforms: transform passes around kernels generated for already-transformed rows.

Fused, the forward transforms every key tile once per query block that visits it (Nq / BLOCK_M times over
a call), and the dK/dV kernel every query tile once per key block; and the kernels multiply half head
dims (rope rotates halves). Hoisted, a transform pass writes each row's transformed copy once (one launch
for q and k, a scratch copy per side); the forward and backward then run plain kernels on the copies, and
a gradient pass carries dQ and dK back through the transforms. The runtime hoists when at least
``HOIST_MIN_QUERY_BLOCKS`` query blocks would each transform the keys.
"""

from __future__ import annotations

from typing import Any

import torch

from ..plan import InputGradient, KernelSpec, Plan
from .backward import BackwardKernels, add_partial_sums, partial_sums
from .forward import ForwardKernel
from .inputs import KVCache, accumulator_dtype, empty_like_layout, position_args
from .kernel import CompiledKernel
from .plugin_args import PluginArgs, Prepared
from .launcher import cdiv
from .packed import Packed
from .packed import launch_args as packed_args

HOIST_MIN_QUERY_BLOCKS = 4  # `attnfuse bench` times both ways (the rope_causal_per_tile rows)


def least_hoisted_queries(block_m: int) -> int:
    """The fewest queries a call hoists with, for the fused forward's ``block_m``."""
    return (HOIST_MIN_QUERY_BLOCKS - 1) * block_m + 1


def worth_hoisting(forward: ForwardKernel, Nq: int) -> bool:
    """Whether a call with ``Nq`` queries runs the plan's passes: at least HOIST_MIN_QUERY_BLOCKS query
    blocks would each transform the keys."""
    return "transform" in forward.plan.kernels and cdiv(Nq, forward.kernel.tiles.block_m) >= HOIST_MIN_QUERY_BLOCKS


class TransformPass:
    """One generated pass over the rows of q and k (the transformed ``sides``), in one launch: apply the
    transforms, or (``gradient``) carry float32 gradients with respect to the transformed rows back to
    the rows themselves."""

    def __init__(self, spec: KernelSpec, interpreted: bool):
        self.kernel = CompiledKernel(spec, interpreted)
        self.sides = spec.sides

    def __call__(
        self,
        rows: dict[str, torch.Tensor],
        pargs: dict[str, Any],
        Hq: int,
        Nq: int,
        grads: dict[str, torch.Tensor] | None = None,
        partials: dict[str, torch.Tensor] | None = None,
        packed: Packed | None = None,
    ) -> dict[str, torch.Tensor]:
        """rows by side: q (B, Hq, Nq, D), k (B, Hkv, Nk, D) -> the transformed rows by side, or with
        ``grads`` (float32, each in its rows' shape and memory order) the gradients of the rows; in the
        rows' dtypes and memory orders. ``pargs``: the plugins' arguments, and the call's positions'.
        ``partials``: receives a gradient pass's partial sums of transform tensor gradients, by parameter.
        ``packed``: packed sequences' document offsets (B = 1), each document's rows at its own positions."""
        sides = self.sides
        outs = {x: empty_like_layout(rows[x], rows[x].shape[3], rows[x].dtype) for x in sides}
        if grads is not None and any(grads[x].stride() != outs[x].stride() for x in sides):
            raise AssertionError("gradient pass: a gradient's strides differ from its rows'")
        B, Nk, Hkv = rows["k"].shape[0], rows["k"].shape[2], rows["k"].shape[1]
        heads = {"q": Hq, "k": Hkv}

        def grid(tiles):
            if packed is None:
                blocks = {"q": cdiv(Nq, tiles.block_m), "k": cdiv(Nk, tiles.block_n)}
            else:  # codegen/packed.py: virtual_blocks
                blocks = {"q": Nq // tiles.block_m + packed.docs, "k": Nk // tiles.block_n + packed.docs}
            return (sum(blocks[x] * B * heads[x] for x in sides),)

        if packed is not None:
            pargs = {**pargs, **packed_args(packed)}

        if grid(self.kernel.tiles)[0]:
            named = partial_sums(self.kernel, grid, rows["k"].shape[3], rows["k"])
            if partials is not None:
                partials.update(named)
            for x in sides:
                named.update({x.upper(): rows[x], f"{x.upper()}Out": outs[x]})
                if grads is not None:
                    named[f"G{x.upper()}"] = grads[x]
            self.kernel.launch(
                grid,
                self.kernel.spec.launch.bind({**named, "HQ": Hq, "Nq": Nq, "N_K": Nk, "BATCH": B, **pargs}),
                rows["k"].device,
            )
        return outs


class HoistedForward:
    """``fused``'s program as a transform pass over k and (if its transforms touch q) q, plus ``main``,
    its forward for transformed rows: with both sides transformed, ``main`` is a plain attention kernel.

    ``plan`` is the fused kernel's: the program as the backward sees it.
    """

    def __init__(self, fused: ForwardKernel, main: ForwardKernel):
        self.plan = fused.plan
        self.main = main
        self.transform = TransformPass(fused.plan.kernels["transform"], fused.plan.config.arch == "interpreter")
        self.plugin_args = fused.plugin_args

    def __call__(
        self, q: torch.Tensor, kv: KVCache, inputs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As ``ForwardKernel.__call__``."""
        out, lse, _ = self.run(q, kv, inputs)
        return out, lse

    def run(
        self, q: torch.Tensor, kv: KVCache, inputs: dict[str, Any], prepared: Prepared | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        """out, lse, and the transformed copies by side ("q", "k"), for the backward to reuse.
        ``prepared``: the plugin arguments, if the caller has them already."""
        prepared = prepared or self.plugin_args(q, kv, inputs)
        copies = self.transform(
            {"q": q, "k": kv.k}, {**prepared.args, **position_args(kv)}, q.shape[1], q.shape[2], packed=kv.packed
        )
        out, lse = self.main(copies.get("q", q), kv._replace(k=copies["k"]), inputs, prepared)
        return out, lse, copies


class HoistedBackward:
    """The backward of a hoisted program: q and k transformed (the forward's copies, or a transform pass),
    ``inner`` (the backward kernels generated for transformed rows, writing float32 dQ and dK), then a
    gradient pass back to q and k."""

    def __init__(self, fused: Plan, inner: BackwardKernels, tensor_grads: tuple[InputGradient, ...] = ()):
        self.inner = inner
        interpreted = fused.config.arch == "interpreter"
        self.transform = TransformPass(fused.kernels["transform"], interpreted)
        self.gradient = TransformPass(
            fused.with_partials("gradient", tuple(g for g in tensor_grads if g.sides)), interpreted
        )
        self.plugin_args = PluginArgs(fused)

    def __call__(
        self,
        q: torch.Tensor,
        kv: KVCache,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        dout: torch.Tensor | None,
        dlse: torch.Tensor | None,
        inputs: dict[str, Any],
        prepared: Prepared | None = None,
        copies: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """As ``BackwardKernels.__call__``. ``copies``: the transformed rows by side that the forward kept
        (``HoistedForward.run``); without them a transform pass writes them again."""
        prepared = prepared or self.plugin_args(q, kv, inputs)
        Hq, Nq = q.shape[1], q.shape[2]
        rows = {"q": q, "k": kv.k}
        pargs = {**prepared.args, **position_args(kv)}
        copies = copies or self.transform(rows, pargs, Hq, Nq, packed=kv.packed)
        dq, dk, dv, grads = self.inner(
            copies.get("q", q),
            kv._replace(k=copies["k"]),
            out,
            lse,
            dout,
            dlse,
            inputs,
            dqk_dtype=accumulator_dtype(q.dtype),
            prepared=prepared,
        )
        partials: dict[str, torch.Tensor] = {}
        of_rows = self.gradient(
            rows, pargs, Hq, Nq, grads={"q": dq, "k": dk}, partials=partials, packed=kv.packed
        )  # float32, with respect to the transformed rows
        add_partial_sums(self.gradient.kernel, partials, inputs, grads)
        return of_rows["q"] if "q" in of_rows else dq.to(q.dtype), of_rows["k"], dv, grads
