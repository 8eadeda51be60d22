"""``Call``: what one call signature runs, decided once; a warm call looks it up and runs it."""

from __future__ import annotations

from typing import Any, Callable

import torch

from .autograd import AttentionFunction, runtime_tensors
from .backward import BackwardKernels
from .decode import DecodeKernel
from .dropout import Dropout
from .forward import ForwardKernel
from .fp8 import Fp8
from .hoisted import HoistedBackward, HoistedForward
from .inputs import KVCache, Positions, kv_cache
from .compiled import Compiled
from .packed import Packed
from .plugin_args import Prepared


class Call:
    """The kernels of one call signature (``launch.planned``) and how they run: ``decode`` (the split-KV
    path), or ``forward`` (fused, or a ``HoistedForward``) and, when gradients are wanted, ``backward``,
    which also writes the gradients of the runtime inputs named in ``grads``: built by ``build_backward``
    when a gradient is first computed, so a forward that is never differentiated generates no backward.
    ``sides``: those of q and k a hoisted forward keeps transformed copies of. ``compiled``: the program's
    kernels these come from, kept alive while the call is cached, so other signatures share them.
    ``kv_layout``: the layout a paged call's pools are read in (``kv_layout.py``), decided with the call;
    None for a contiguous cache."""

    def __init__(
        self,
        compiled: Compiled,
        *,
        forward: ForwardKernel | HoistedForward | None = None,
        decode: DecodeKernel | None = None,
        build_backward: Callable[[], BackwardKernels | HoistedBackward] | None = None,
        grads: tuple[str, ...] = (),
        kv_layout: str | None = None,
    ):
        self.compiled = compiled
        self.forward = forward
        self.decode = decode
        self.build_backward = build_backward  # ``Compiled`` memoises it: every call returns the same kernels
        self.grads = grads
        self.kv_layout = kv_layout
        self._hoisted = isinstance(forward, HoistedForward)
        self.sides = forward.transform.sides if self._hoisted else ()

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        inputs: dict[str, Any],
        kv_lens: torch.Tensor | None,
        block_table: torch.Tensor | None,
        positions: Positions | None = None,
        packed: Packed | None = None,
        fp8: Fp8 | None = None,
        dropout: Dropout | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """out (B, Hq, Nq, DV) and lse (B, Hq, Nq) or None; differentiable when the call has a backward.
        ``positions``: the call's (checked), when its signature has them; ``packed``: likewise its document
        offsets; ``fp8``: a float8 call's descales and out dtype; ``dropout``: its attention dropout."""
        kv = kv_cache(k, v, kv_lens, block_table, positions, self.kv_layout, packed, fp8, dropout)
        if self.decode is not None:
            return self.decode(q, kv, inputs)
        if self.build_backward is None:
            return self.forward(q, kv, inputs)
        tensors, names = runtime_tensors(inputs)
        return AttentionFunction.apply(
            self, inputs, tuple(names), positions, packed, dropout, q, k, v, kv_lens, *tensors
        )

    @property
    def backward(self) -> BackwardKernels | HoistedBackward | None:
        """The backward kernels, generated on first use; None when the call wants no gradient."""
        return None if self.build_backward is None else self.build_backward()

    def prepare(self, q: torch.Tensor, kv: KVCache, inputs: dict[str, Any]) -> Prepared:
        """The plugins' kernel arguments, for a forward and its backward alike."""
        return self.forward.plugin_args(q, kv, inputs)

    def run_forward(
        self, q: torch.Tensor, kv: KVCache, inputs: dict[str, Any], prepared: Prepared
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        """out, lse, and a hoisted forward's transformed copies of q and k by side (else none), which the
        backward reads instead of transforming q and k again."""
        if self._hoisted:
            return self.forward.run(q, kv, inputs, prepared)
        return (*self.forward(q, kv, inputs, prepared), {})

    def run_backward(
        self,
        q: torch.Tensor,
        kv: KVCache,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        dout: torch.Tensor | None,
        dlse: torch.Tensor | None,
        inputs: dict[str, Any],
        prepared: Prepared | None,
        copies: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """dq, dk, dv and the gradients of ``grads`` by name (``BackwardKernels.__call__``)."""
        extra = {"copies": copies} if copies else {}
        return self.backward(q, kv, out, lse, dout, dlse, inputs, prepared=prepared, **extra)
