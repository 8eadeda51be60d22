"""``CallSpec``: what is static about a program call, and its key, the op's static argument.

The key is the spec's data form (``to_data``: the graph as ``ir.to_data`` writes it, plain values besides),
JSON-encoded: a torch op takes no Python object as a graph constant on every supported torch, but a string.
A key this process made maps back to its spec without parsing. A compiled graph loaded from a cache in a
fresh process carries keys this process never made: ``spec_of`` rebuilds those from their data with the
IR's constructors (nothing is evaluated), resolving each combinator by name as tracing does.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from attrs import field, frozen
from attrs.validators import in_, instance_of

from . import ir
from .block_mask import BlockMask
from .block_mask_checks import TENSORS as MASK_TENSORS
from .errors import InputError, PluginError
from .lru import LRUCache
from .plugin_manager import registered
from .runtime.dropout import check_dropout_p
from .runtime.kv_layout import KV_LAYOUTS


@frozen(kw_only=True, cache_hash=True)
class CallSpec:
    """What is static about one kind of program call.

    ``inputs``: (argument name, None for a tensor or (Nq, Nk, block_size, kv_heavy_blocks) for a BlockMask)
    in the order of the op's input list. ``save_lse``: the op returns lse (B, Hq, Nq), else an empty (0,)
    tensor. ``grad``: the call is differentiable (no split-KV path). ``grads``: the inputs whose gradient the
    backward returns. ``validate``: the call checks its kv_lens and block_table values (``validate.py``).
    ``kv_layout``: a paged call's pool layout as the caller named it ("NHD", "HND"), or None
    (``runtime/kv_layout.py``). ``dropout_p``: the call's attention dropout rate in [0, 1); with p > 0 the op
    takes the call's dropout state (``runtime/dropout.py``)."""

    graph: ir.MatMulPV = field(validator=instance_of(ir.MatMulPV))
    inputs: tuple
    save_lse: bool
    grad: bool
    grads: tuple
    validate: bool = True
    kv_layout: str | None = field(default=None, validator=in_((None, *KV_LAYOUTS)))
    dropout_p: float = field(default=0.0, converter=check_dropout_p)

    def to_data(self) -> dict[str, Any]:
        """The spec as plain data (JSON's types)."""
        return {
            "graph": ir.to_data(self.graph),
            "inputs": [[name, mask] for name, mask in self.inputs],
            "save_lse": self.save_lse,
            "grad": self.grad,
            "grads": list(self.grads),
            "validate": self.validate,
            "kv_layout": self.kv_layout,
            **({"dropout_p": self.dropout_p} if self.dropout_p else {}),  # keys without dropout as before it
        }

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> CallSpec:
        """The spec ``to_data`` gave ``data`` for (combinators resolved by name)."""
        return cls(
            graph=ir.from_data(data["graph"], registered),
            inputs=tuple(
                (str(name), None if mask is None else tuple(int(n) for n in mask)) for name, mask in data["inputs"]
            ),
            save_lse=bool(data["save_lse"]),
            grad=bool(data["grad"]),
            grads=tuple(map(str, data["grads"])),
            validate=bool(data.get("validate", True)),  # keys made before it was a field validate
            kv_layout=data.get("kv_layout"),
            dropout_p=data.get("dropout_p", 0.0),
        )  # and read their pools as a call naming no layout


MAX_SPECS = 1024  # call specs kept (a program's few per configuration); one dropped is rebuilt if needed
_specs: LRUCache[str, CallSpec] = LRUCache(MAX_SPECS)
_keys: LRUCache[tuple, str] = LRUCache(MAX_SPECS)  # by the spec's fields: a warm call builds no CallSpec


def key_of(
    graph: ir.MatMulPV,
    inputs: tuple,
    save_lse: bool,
    grad: bool,
    grads: tuple,
    validate: bool = True,
    kv_layout: str | None = None,
    dropout_p: float = 0.0,
) -> str:
    """The op's string argument for the spec of these fields (registered, so the op finds it unparsed)."""
    fields = (graph, inputs, save_lse, grad, grads, validate, kv_layout, dropout_p)
    key = _keys.get(fields)
    if key is None:
        key = _keys.get_or_build(
            fields,
            lambda: _register(
                CallSpec(
                    graph=graph,
                    inputs=inputs,
                    save_lse=save_lse,
                    grad=grad,
                    grads=grads,
                    validate=validate,
                    kv_layout=kv_layout,
                    dropout_p=dropout_p,
                )
            ),
        )
    return key


def _register(spec: CallSpec) -> str:
    """Keep ``spec`` under its key; the key."""
    key = json.dumps(spec.to_data(), separators=(",", ":"))
    _specs.get_or_build(key, lambda: spec)
    return key


def call_key(spec: CallSpec) -> str:
    """The op's string argument for ``spec``."""
    return key_of(
        spec.graph, spec.inputs, spec.save_lse, spec.grad, spec.grads, spec.validate, spec.kv_layout, spec.dropout_p
    )


def spec_of(key: str) -> CallSpec:
    """The spec of an op's key: one this process made, or one rebuilt from the key's data."""
    return _specs.get_or_build(key, lambda: _rebuilt(key))


def _rebuilt(key: str) -> CallSpec:
    """A ``CallSpec`` from its key's data; an InputError for a key that is no spec's."""
    try:
        return CallSpec.from_data(json.loads(key))
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError, PluginError):
        raise InputError(
            f"attnfuse::attention: key must be the data of a CallSpec (CallSpec.to_data, "
            f"JSON-encoded), got {key[:80]!r}"
        ) from None


def flatten_inputs(inputs: dict[str, Any]) -> tuple[tuple, list[torch.Tensor]]:
    """The spec's input layout and the op's tensor list for runtime inputs by name."""
    layout, tensors = [], []
    for name, value in inputs.items():
        if isinstance(value, BlockMask):
            value.check_unchanged()
            layout.append((name, (value.Nq, value.Nk, value.block_size, value.kv_heavy_blocks)))
            tensors += value.tensors()
        else:
            layout.append((name, None))
            tensors.append(value)
    return tuple(layout), tensors


def unflatten_inputs(spec: CallSpec, tensors: list[torch.Tensor]) -> dict[str, Any]:
    """The runtime inputs by name from the op's tensor list (block masks rebuilt, refused if edited)."""
    inputs, i = {}, 0
    for name, mask in spec.inputs:
        if mask is None:
            inputs[name], i = tensors[i], i + 1
        else:
            inputs[name] = BlockMask.rebuilt(mask, tensors[i : i + len(MASK_TENSORS)])
            i += len(MASK_TENSORS)
    return inputs


def plain_tensors(spec: CallSpec, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensor inputs by name from the op's tensor list (block masks' tensors left out)."""
    found, i = {}, 0
    for name, mask in spec.inputs:
        if mask is None:
            found[name] = tensors[i]
        i += 1 if mask is None else len(MASK_TENSORS)
    return found


def tensor_names(spec: CallSpec) -> list[str]:
    """The argument name of each tensor of the op's list (a block mask's name for each of its tensors)."""
    return [name for name, mask in spec.inputs for _ in range(1 if mask is None else len(MASK_TENSORS))]
