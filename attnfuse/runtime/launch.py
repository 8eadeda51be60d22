"""``run_attention``: check the inputs, find the program's compiled kernels by signature, launch them."""
from __future__ import annotations

from typing import Any

import torch

from .. import ir
from ..errors import InputError
from ..lru import LRUCache
from ..passes.lower import Instance, KernelConfig, fragment_of
from ..passes.plan import Plan, build_plan
from .autograd import AttentionFunction, Kernels, runtime_tensors
from .backward import BackwardKernels
from .decode import MAX_QUERIES, DecodeKernel
from .forward import ForwardKernel
from .gradients import check_differentiable
from .gradients import tensor_grads as tensor_grads_of
from .hoisted import HoistedBackward, HoistedForward, worth_hoisting
from .inputs import Positions, check_cache, check_inputs, check_positions, kernel_config, kv_cache
from .kernel import CompiledKernel
from .offsets import inputs_fit
from .plugin_args import check_takes_offsets
from .validate import check_cache_values

__all__ = ["KERNEL_KINDS", "check_cache", "check_inputs", "clear_cache", "compile_backward", "compile_decode",
           "compile_forward", "compile_plan", "compiled_kernel", "kernel_config", "run_attention"]

CallKernels = tuple[ForwardKernel | HoistedForward, DecodeKernel | None, BackwardKernels | HoistedBackward | None]

# The in-process caches, least recently used dropped first (``lru.py``). A model runs a few configurations of
# each program (dtype, head dims, lse, gradients, decoding), and a program traced for more than
# RECOMPILE_LIMIT (8) configurations warns (``recompile.py``): each kernel cache holds 16 such programs' worth.
# A plan is small beside its kernels (no binaries), and shared by them. A call signature (shapes and strides
# included: one per sequence length) is a small tuple of references; those are forgotten whenever a kernel
# is dropped, so they never keep a dropped kernel alive.
MAX_PLANS = 256
MAX_KERNELS = 128
MAX_CALLS = 4096

_calls: LRUCache[tuple, CallKernels] = LRUCache(MAX_CALLS)  # call signature -> kernels
_compiled: LRUCache[tuple[ir.MatMulPV, KernelConfig], Plan] = LRUCache(MAX_PLANS)
_forward: LRUCache[tuple[ir.MatMulPV, KernelConfig], ForwardKernel] = LRUCache(MAX_KERNELS, _calls.clear)
_decode: LRUCache[tuple[ir.MatMulPV, KernelConfig], DecodeKernel] = LRUCache(MAX_KERNELS, _calls.clear)
_backward: LRUCache[tuple, BackwardKernels | HoistedBackward] = LRUCache(MAX_KERNELS, _calls.clear)
_hoisted: LRUCache[tuple[ir.MatMulPV, KernelConfig], HoistedForward] = LRUCache(MAX_KERNELS, _calls.clear)


def compile_plan(graph: ir.MatMulPV, config: KernelConfig) -> Plan:
    """The compiler's plan of ``graph`` for ``config`` (every kernel's spec; sources on first use), cached."""
    return _compiled.get_or_build((graph, config), lambda: build_plan(graph, config))


def compile_forward(graph: ir.MatMulPV, config: KernelConfig) -> ForwardKernel:
    """The forward kernel of ``graph`` for ``config``, generated on first use and cached."""
    return _forward.get_or_build((graph, config), lambda: ForwardKernel(compile_plan(graph, config)))


def compile_hoisted(graph: ir.MatMulPV, config: KernelConfig) -> HoistedForward:
    """The forward of ``graph`` with its qk transforms hoisted into transform passes over q and k."""
    def build() -> HoistedForward:
        fused = compile_forward(graph, config)
        return HoistedForward(fused, compile_forward(graph, fused.plan.hoisted_config))
    return _hoisted.get_or_build((graph, config), build)


def compile_hoisted_backward(graph: ir.MatMulPV, config: KernelConfig,
                             tensor_grads: tuple[tuple[Instance, str], ...] = ()) -> HoistedBackward:
    """The backward of ``graph`` with its qk transforms hoisted into transform and gradient passes."""
    def build() -> HoistedBackward:
        fused = compile_plan(graph, config)
        return HoistedBackward(fused, compile_backward(graph, fused.hoisted_config, tensor_grads))
    key = (graph, config, "hoisted", tuple((inst.prefix, name) for inst, name in tensor_grads))
    return _backward.get_or_build(key, build)


def compile_decode(graph: ir.MatMulPV, config: KernelConfig) -> DecodeKernel:
    """The split-KV decoding kernel of ``graph`` for ``config``, generated on first use and cached."""
    return _decode.get_or_build((graph, config), lambda: DecodeKernel(compile_plan(graph, config)))


def compile_backward(graph: ir.MatMulPV, config: KernelConfig,
                     tensor_grads: tuple[tuple[Instance, str], ...] = ()) -> BackwardKernels:
    """The backward kernels of ``graph`` for ``config``, writing the tensor gradients named."""
    key = (graph, config, tuple((inst.prefix, name) for inst, name in tensor_grads))
    return _backward.get_or_build(key, lambda: BackwardKernels(compile_plan(graph, config), tensor_grads))


KERNEL_KINDS = ("forward", "decode", "dkdv", "dq", "transform")


def compiled_kernel(graph: ir.MatMulPV, config: KernelConfig, kind: str) -> CompiledKernel:
    """One generated kernel of ``graph``: ``kind`` is "forward", "decode" (split-KV), "dkdv", "dq" or
    "transform" (the pass that applies the qk transforms to q and k rows once, when the keys have some)."""
    if kind == "forward":
        return compile_forward(graph, config).kernel
    if kind == "transform":
        if compile_plan(graph, config).transform is None:
            raise InputError("kernel='transform': this program has no key-side qk transform to hoist (or reads "
                             "a cache with kv_lens or pages, where the transform stays in the key loop)")
        return compile_hoisted(graph, config).transform.kernel
    if kind == "decode":
        if config.positions:
            raise InputError("kernel='decode': the split-KV kernel places queries bottom-right; a call with "
                             "q_offset or k_offset runs the forward kernel")
        return compile_decode(graph, config).kernel
    if kind in ("dkdv", "dq"):
        return getattr(compile_backward(graph, config), kind)
    raise InputError(f"kernel must be one of {', '.join(KERNEL_KINDS)}, got {kind!r}")


def clear_cache() -> None:
    """Forget every compiled kernel, e.g. after registering a plugin with new tile rules."""
    _compiled.clear()
    _forward.clear()
    _decode.clear()
    _backward.clear()
    _hoisted.clear()
    _calls.clear()


def keeps_lse(graph: ir.MatMulPV, return_lse: bool) -> bool:
    """Whether the program's normaliser has a log-sum-exp; an InputError when ``return_lse`` asks for one
    it has not."""
    has_lse = fragment_of(graph.weights.apply).has_lse
    if return_lse and not has_lse:
        raise InputError(f"return_lse=True needs a normaliser with a log-sum-exp; "
                         f"{graph.weights.apply.combinator} has none (softmax has)")
    return has_lse


def run_attention(graph: ir.MatMulPV, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  inputs: dict[str, Any] | None = None, *, return_lse: bool = False,
                  kv_lens: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                  split_kv: bool | None = None, validate: bool = True, q_offset: int | None = None,
                  k_offset: int | None = None, seq_len: int | None = None):
    """Run a traced program on q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, DV).

    Differentiable (q, k, v and declared tensor inputs) when autograd asks for gradients.

    :param inputs: runtime inputs (bias, cos/sin tables, ...) by argument name of the traced function.
    :param kv_lens: (B,) int32 (or int64) keys per sequence; query i of sequence b sits at position
        i + kv_lens[b] - Nq. Values above the capacity count as the capacity.
    :param block_table: (B, max_pages) int32 (or int64) page indices, for a paged cache: k, v are then
        pools (pages, page_size, Hkv, D) and kv_lens is required.
    :param split_kv: run the split-KV decoding path (None: when Nq <= 16, no gradient is wanted and the
        normaliser can combine splits).
    :param validate: with ``kv_lens``, check their values (and a paged cache's table) before launching: every
        length in [0, 2**31 - 1], every block_table entry a sequence uses (its first
        ceil(min(kv_lens[b], capacity) / page_size)) a page of the pool; entries past those may hold
        anything. One small kernel and one host sync per call. ``validate=False`` skips both (a server
        that checks upstream; a CUDA graph capture, which cannot sync): lengths outside [0, capacity]
        then count as the nearest bound, and keys on a page outside the pool are absent (the kernels
        never read outside the pool).
    :param q_offset: the position of query 0 (query i at q_offset + i) and ``k_offset`` that of key 0 (key
        j at k_offset + j): a chunk of a longer sequence (chunked prefill, a shard of context parallelism).
        Either given, the other defaults to 0; not with kv_lens or block_table. Masks, position biases and
        rotations follow these positions; tensors a plugin indexes by query and key (additive_bias's
        bias, a BlockMask) still follow the call's indices. None (default): key j at j, query i at
        i + Nk - Nq. Runtime values: a new offset compiles nothing.
    :param seq_len: with offsets, the sequence's length (default: the last position plus one), what
        fragments read as the number of keys (relu_attention divides by it).
    :return: out (B, Hq, Nq, DV), or (out, lse) with lse (B, Hq, Nq) float32 when ``return_lse``.
    """
    inputs = inputs or {}
    wants_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, *inputs.values()))
    inputs_wide = bool(inputs) and not inputs_fit(inputs)
    positions = None
    if q_offset is not None or k_offset is not None or seq_len is not None:
        check_inputs(q, k, v, paged=block_table is not None)
        positions = check_positions(q_offset, k_offset, seq_len, q.shape[2], k.shape[2], kv_lens, block_table)
    forward, decode, backward = planned(graph, q, k, v, kv_lens, block_table, return_lse, wants_grad, split_kv,
                                        inputs_wide, positions)
    if validate and kv_lens is not None:
        check_cache_values(kv_lens, block_table, *(k.shape[:2] if block_table is not None else (0, 0)))
    kv = kv_cache(k, v, kv_lens, block_table, positions)
    if decode is not None:
        out, lse = decode(q, kv, inputs)
    elif not wants_grad:
        out, lse = forward(q, kv, inputs)
    else:
        wanted = [n for n, t in inputs.items() if isinstance(t, torch.Tensor) and t.requires_grad]
        tensor_grads = tensor_grads_of(forward.plan.lowered, inputs, wanted, (*q.shape[:3], kv.capacity)) \
            if wanted else ()
        if tensor_grads:
            compile_ = compile_hoisted_backward if isinstance(forward, HoistedForward) else compile_backward
            backward = compile_(graph, forward.plan.config, tensor_grads)
        grads = tuple(dict.fromkeys(inst.apply.inputs()[name].name for inst, name in tensor_grads))
        tensors, names = runtime_tensors(inputs)
        out, lse = AttentionFunction.apply(Kernels(forward, backward, grads), inputs, tuple(names), positions, q, k,
                                           v, kv_lens, *tensors)
    return (out, lse) if return_lse else out


def planned(graph: ir.MatMulPV, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lens: Any, block_table: Any,
            return_lse: bool, wants_grad: bool, split_kv: bool | None, inputs_wide: bool = False,
            positions: Positions | None = None) -> CallKernels:
    """The call's kernels: everything decided from its metadata alone is decided once per call signature
    (``inputs_wide``: some runtime input needs 64-bit offsets, ``offsets.inputs_fit``; ``positions``: the
    call's, checked, whose presence alone matters here)."""
    signature = (graph, _meta(q), _meta(k), _meta(v), _meta(kv_lens), _meta(block_table), return_lse, wants_grad,
                 split_kv, torch.backends.cuda.matmul.allow_tf32, inputs_wide, positions is not None)
    kernels = _calls.get(signature)
    if kernels is None:
        kernels = _calls.get_or_build(signature, lambda: _plan(graph, q, k, v, kv_lens, block_table, return_lse,
                                                              wants_grad, split_kv, inputs_wide, positions))
    return kernels


class _Invalid:
    """Stands for an argument that is not a tensor in a call signature (the checks then raise)."""


def _meta(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        return t.shape, t.stride(), t.dtype, t.device
    return None if t is None else _Invalid()


def _plan(graph: ir.MatMulPV, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lens: Any, block_table: Any,
          return_lse: bool, wants_grad: bool, split_kv: bool | None, inputs_wide: bool,
          positions: Positions | None) -> CallKernels:
    """Check a new call signature; its forward kernel, its split-KV kernel if it takes that path, and with
    gradients wanted the backward kernels (those that write no tensor input's gradient). A call that gives
    its positions never takes the split-KV path (its kernel places queries bottom-right)."""
    kv = check_cache(q, k, v, kv_lens, block_table)._replace(positions=positions)
    has_lse = keeps_lse(graph, return_lse)
    if wants_grad and block_table is not None:
        raise InputError("gradients through a paged cache are not supported; pass contiguous k and v to train")
    forward = compile_forward(graph, kernel_config(q, kv, return_lse or (wants_grad and has_lse), inputs_wide))
    if positions is not None:
        check_takes_offsets(forward.plan.lowered)
    norm = forward.plan.lowered.normaliser.fragment
    can_split = not wants_grad and norm.combine is not None and norm.partial is None and positions is None
    if split_kv is None:
        split_kv = can_split and q.shape[2] <= MAX_QUERIES
    elif split_kv and not can_split:
        raise InputError("the split-KV path has no backward, needs a normaliser that can combine splits (and "
                         "declares no partial fragment), and takes no q_offset or k_offset")
    if split_kv:
        return forward, compile_decode(graph, forward.plan.config), None
    if wants_grad:
        check_differentiable(forward.plan.lowered)
    if worth_hoisting(forward, q.shape[2]):
        forward = compile_hoisted(graph, forward.plan.config)
        return forward, None, compile_hoisted_backward(graph, forward.plan.config) if wants_grad else None
    return forward, None, compile_backward(graph, forward.plan.config) if wants_grad else None
