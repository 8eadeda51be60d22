"""The plugins' kernel arguments of one call: each plugin's ``prepare`` on the call's launch context."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..errors import InputError, PluginError
from ..plan import Plan
from .inputs import KVCache, launch_context


class Prepared(NamedTuple):
    """What the plugins of one call give: the kernel arguments by parameter name (each tensor, each scalar;
    a tensor's strides are bound from it); the largest tile a block-listing mask allows (its block size) or
    None; and how many of its heavy key blocks the dK/dV kernel splits over a GQA group's query heads
    (``BlockList.q_split``)."""

    args: dict[str, Any]
    limit: int | None
    heavy: int


def check_takes_offsets(plan: Plan) -> None:
    """InputError when a combinator of ``plan`` has a ``prepare`` but does not declare ``takes_offsets``: a
    call that gives q_offset or k_offset places keys at positions past the call's rows, which a plugin
    written for positions that are indices could read its tensors at."""
    name = plan.refuses_offsets
    if name is not None:
        raise InputError(
            f"q_offset/k_offset: {name} prepares kernel arguments but does not declare "
            f"takes_offsets=True (that its fragments index its tensors by k_idx, q_idx or heads, "
            f"and its prepare follows LaunchContext.seq_len), so it may read them at positions "
            f"past the call's rows; call it without offsets"
        )


class PluginArgs:
    """The kernel arguments the plugins of one plan give through ``prepare``."""

    def __init__(self, plan: Plan):
        self._plugins = tuple((call.prefix, call.apply, call.apply.declaration) for call in plan.plugin_calls)
        self._names = plan.plugin_args
        self._limit = plan.block_limit
        self._split = plan.heavy_split

    def __call__(self, q: torch.Tensor, kv: KVCache, inputs: dict[str, Any]) -> Prepared:
        """The plugins' arguments for one call."""
        args: list = []
        scalars: dict[str, Any] = {}
        ctx = launch_context(q, kv) if self._plugins else None
        for prefix, apply, comb in self._plugins:
            prepared = comb.prepare(ctx, **apply.values(inputs))
            for t in comb.tensors:
                tensor = prepared[t.name]
                if not isinstance(tensor, torch.Tensor) or tensor.dim() != t.rank:
                    raise PluginError(
                        f"{comb.name}.prepare() must return {t.name!r} as a {t.rank}-D tensor, "
                        f"got {getattr(tensor, 'shape', type(tensor).__name__)}"
                    )
                if tensor.device != ctx.device:
                    raise InputError(f"{comb.name}: {t.name!r} is on {tensor.device}, the inputs on {ctx.device}")
                args.append(tensor)
            for sc in comb.scalars:
                args.append(prepared[sc.name])
                scalars[f"{prefix}_{sc.name}"] = prepared[sc.name]
        return Prepared(
            dict(zip(self._names, args, strict=True)),
            None if self._limit is None else int(scalars[self._limit]),
            int(scalars[self._split]) if self._split else 0,
        )
