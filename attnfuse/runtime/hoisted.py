"""Hoisted qk transforms: transform passes around kernels generated for already-transformed rows.

Fused, the forward transforms every key tile once per query block that visits it (Nq / BLOCK_M times over
a call), and the dK/dV kernel every query tile once per key block; and the kernels multiply half head
dims (rope rotates halves). Hoisted, transform passes write each row's transformed copy once (a launch
and a scratch copy per side); the forward and backward then run plain kernels on the copies, and
gradient passes carry dQ and dK back through the transforms. The runtime hoists when at least
``HOIST_MIN_QUERY_BLOCKS`` query blocks would each transform the keys.
"""
from __future__ import annotations

from typing import Any

import attrs
import torch

from ..passes.codegen import generate_gradient_pass, generate_transform_pass
from ..passes.codegen.transform_pass import pass_name
from ..passes.lower import TiledKernel
from .backward import BackwardKernels
from .forward import ForwardKernel, constexprs
from .inputs import KVCache, PluginArgs, accumulator_dtype, empty_like_layout
from .kernel import CompiledKernel
from .launcher import cdiv

HOIST_MIN_QUERY_BLOCKS = 4  # benchmarks/bench_attention.py times both ways (the rope_causal_per_tile rows)


def hoistable(tiled: TiledKernel) -> bool:
    """Whether a program's keys have transforms a pass can apply (contiguous keys, one length for all)."""
    return (any(t.fragment.k for t in tiled.transforms) and not tiled.config.kv_lens and not tiled.config.paged
            and not tiled.config.k_transformed)


def worth_hoisting(forward: ForwardKernel, Nq: int) -> bool:
    return hoistable(forward.tiled) and cdiv(Nq, forward.kernel.tiles.block_m) >= HOIST_MIN_QUERY_BLOCKS


def transformed_sides(tiled: TiledKernel) -> dict[str, bool]:
    """q_transformed / k_transformed: the sides whose transforms the passes apply."""
    return {f"{x}_transformed": any(getattr(t.fragment, x) for t in tiled.transforms) for x in "qk"}


class TransformPass:
    """One generated pass over the rows of q or k (``x``): apply the transforms, or (``gradient``) carry a
    float32 gradient with respect to the transformed rows back to the rows themselves."""

    def __init__(self, tiled: TiledKernel, x: str, gradient: bool = False):
        generate = generate_gradient_pass if gradient else generate_transform_pass
        self.kernel = CompiledKernel(pass_name(tiled, x, gradient), generate(tiled, x),
                                     tiled.config.arch == "interpreter", tiled.tiles)
        self.x = x

    def __call__(self, rows: torch.Tensor, pargs: list, constexprs: dict, Hq: int, Nq: int, Nk: int,
                 grad: torch.Tensor | None = None) -> torch.Tensor:
        """rows (B, H, N, D) -> transformed rows, or with ``grad`` (rows' shape and memory order, float32)
        the gradient of ``rows``; in ``rows``' dtype and memory order."""
        B, H, N, D = rows.shape
        out = empty_like_layout(rows, D, rows.dtype)
        if out.numel() == 0:
            return out
        if grad is not None and grad.stride() != out.stride():
            raise AssertionError(f"gradient pass: grad strides {grad.stride()} differ from {out.stride()}")
        block = "block_m" if self.x == "q" else "block_n"
        self.kernel.launch(lambda tiles: (cdiv(N, getattr(tiles, block)), B * H),
                           (rows, out, *(() if grad is None else (grad,)), *rows.stride(), *out.stride(), Hq, Nq, Nk,
                            *pargs), rows.device, **constexprs)
        return out


class HoistedForward:
    """``fused``'s program as transform passes over k and (if its transforms touch q) q, plus ``main``,
    its forward for transformed rows: with both sides transformed, ``main`` is a plain attention kernel.

    ``tiled`` is the fused kernel's: the program as the backward sees it.
    """

    def __init__(self, fused: ForwardKernel, main: ForwardKernel):
        self.tiled = fused.tiled
        self.main = main
        self.keys = TransformPass(fused.tiled, "k")
        self.queries = TransformPass(fused.tiled, "q") if main.tiled.config.q_transformed else None
        self.plugin_args = fused.plugin_args
        self.constexprs = fused.constexprs

    def __call__(self, q: torch.Tensor, kv: KVCache, inputs: dict[str, Any]
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As ``ForwardKernel.__call__``."""
        out, lse, _ = self.run(q, kv, inputs)
        return out, lse

    def run(self, q: torch.Tensor, kv: KVCache, inputs: dict[str, Any]
            ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        """out, lse, and the transformed copies by side ("q", "k"), for the backward to reuse."""
        prepared = self.plugin_args(q, kv, inputs)
        sizes = (q.shape[1], q.shape[2], kv.capacity)
        copies = {"k": self.keys(kv.k, prepared[0], self.constexprs, *sizes)}
        if self.queries is not None:
            copies["q"] = self.queries(q, prepared[0], self.constexprs, *sizes)
        out, lse = self.main(copies.get("q", q), attrs.evolve(kv, k=copies["k"]), inputs, prepared)
        return out, lse, copies


class HoistedBackward:
    """The backward of a hoisted program: q and k transformed (the forward's copies, or transform passes),
    ``inner`` (the backward kernels generated for transformed rows, writing float32 dQ and dK), then
    gradient passes back to q and k."""

    def __init__(self, fused: TiledKernel, inner: BackwardKernels):
        self.inner = inner
        sides = transformed_sides(fused)
        self.passes = {x: (TransformPass(fused, x), TransformPass(fused, x, gradient=True))
                       for x in "qk" if sides[f"{x}_transformed"]}
        self.plugin_args = PluginArgs(fused)
        self.constexprs = constexprs(fused)  # the passes'

    def __call__(self, q: torch.Tensor, kv: KVCache, out: torch.Tensor, lse: torch.Tensor | None,
                 dout: torch.Tensor | None, dlse: torch.Tensor | None, inputs: dict[str, Any],
                 copies: dict[str, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """As ``BackwardKernels.__call__``. ``copies``: transformed rows by side that the forward kept
        (``HoistedForward.run``); the passes run for the sides missing."""
        prepared = self.plugin_args(q, kv, inputs)
        pargs = prepared[0]
        sizes = (q.shape[1], q.shape[2], kv.capacity)
        rows = {"q": q, "k": kv.k}
        copies = copies or {}
        transformed = {x: copies[x] if x in copies else apply(rows[x], pargs, self.constexprs, *sizes)
                       for x, (apply, _) in self.passes.items()}
        dq, dk, dv, grads = self.inner(transformed.get("q", q), attrs.evolve(kv, k=transformed.get("k", kv.k)), out,
                                       lse, dout, dlse, inputs, dqk_dtype=accumulator_dtype(q.dtype),
                                       prepared=prepared)
        of_transformed = {"q": dq, "k": dk}  # float32, with respect to the transformed rows where hoisted
        of_rows = {x: gradient(rows[x], pargs, self.constexprs, *sizes, grad=of_transformed[x])
                   for x, (_, gradient) in self.passes.items()}
        return of_rows.get("q", dq.to(q.dtype)), of_rows.get("k", dk.to(kv.k.dtype)), dv, grads
