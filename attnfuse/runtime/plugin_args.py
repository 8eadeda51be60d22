"""The plugins' kernel arguments of one call: each plugin's ``prepare`` on the call's launch context."""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..errors import InputError, PluginError
from ..passes.launch_spec import STRIDE
from ..passes.lower import LoweredProgram
from .inputs import KVCache, launch_context


class Prepared(NamedTuple):
    """What the plugins of one call give: the kernel arguments by parameter name (each tensor, each scalar;
    a tensor's strides are bound from it); the largest tile a block-listing mask allows (its block size) or
    None; and how many of its heavy key blocks the dK/dV kernel splits over a GQA group's query heads
    (``BlockList.q_split``)."""

    args: dict[str, Any]
    limit: int | None
    heavy: int


def check_takes_offsets(lowered: LoweredProgram) -> None:
    """InputError unless every combinator of ``lowered`` with a ``prepare`` declares ``takes_offsets``: a call
    that gives q_offset or k_offset places keys at positions past the call's rows, which a plugin written
    for positions that are indices could read its tensors at."""
    for inst in lowered.instances():
        comb = inst.apply.declaration
        if comb.prepare is not None and not comb.takes_offsets:
            raise InputError(f"q_offset/k_offset: {comb.name} prepares kernel arguments but does not declare "
                             f"takes_offsets=True (that its fragments index its tensors by k_idx, q_idx or heads, "
                             f"and its prepare follows LaunchContext.seq_len), so it may read them at positions "
                             f"past the call's rows; call it without offsets")


class PluginArgs:
    """The kernel arguments the plugins of one lowered program give through ``prepare``."""

    def __init__(self, lowered: LoweredProgram):
        self._plugins = tuple((inst, inst.apply.declaration) for inst in lowered.instances() if inst.args)
        self._names = tuple(p.name for p in lowered.args() if p.kind != STRIDE)  # strides come with tensors
        listing = next((m.fragment.block_list for m in lowered.masks if m.fragment.block_list is not None), None)
        self._limit = listing and listing.size
        self._split = listing and listing.q_split

    def __call__(self, q: torch.Tensor, kv: KVCache, inputs: dict[str, Any]) -> Prepared:
        """The plugins' arguments for one call."""
        args: list = []
        scalars: dict[str, Any] = {}
        ctx = launch_context(q, kv) if self._plugins else None
        for inst, comb in self._plugins:
            prepared = comb.prepare(ctx, **inst.apply.values(inputs))
            for t in comb.tensors:
                tensor = prepared[t.name]
                if not isinstance(tensor, torch.Tensor) or tensor.dim() != t.rank:
                    raise PluginError(f"{comb.name}.prepare() must return {t.name!r} as a {t.rank}-D tensor, "
                                      f"got {getattr(tensor, 'shape', type(tensor).__name__)}")
                if tensor.device != ctx.device:
                    raise InputError(f"{comb.name}: {t.name!r} is on {tensor.device}, the inputs on {ctx.device}")
                args.append(tensor)
            for sc in comb.scalars:
                args.append(prepared[sc.name])
                scalars[f"{inst.prefix}_{sc.name}"] = prepared[sc.name]
        return Prepared(dict(zip(self._names, args, strict=True)),
                        None if self._limit is None else int(scalars[self._limit]),
                        int(scalars[self._split]) if self._split else 0)
