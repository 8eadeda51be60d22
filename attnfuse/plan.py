"""The Plan: what the compiler (``passes.compiler.compile``) tells the runtime about one program.

The compiler writes a ``Plan`` per (graph, ``KernelConfig``); the runtime reads it and nothing else of the
compiler. It holds every fact a call needs: the kernels (a ``KernelSpec`` each, by kind: name, tiles, launch
spec, source on first use), which plugins give kernel arguments, how split-KV results merge, whether the
program has a backward, which runtime inputs can have gradients, the masks' key ranges (for a context-parallel
ring) and whether the Hopper templates serve it.

``KERNEL_KINDS`` is the one list of kernel kinds: a new kind is its kernel, its spec in the plan and a line
there.
"""

from __future__ import annotations

import functools
import string
from types import MappingProxyType
from typing import Callable, Mapping

import attrs
from attrs import field, frozen

from . import ir
from .launch_spec import LaunchSpec, Param
from .tiles import TileConfig


KERNEL_KINDS: Mapping[str, str] = MappingProxyType(
    {
        "forward": "fwd",  # the forward kernel
        "decode": "decode",  # the split-KV decoding kernel
        "dkdv": "dkdv",  # the backward's dK/dV kernel
        "dq": "dq",  # the backward's dQ kernel (it writes each row's delta, and score-shaped input gradients)
        "transform": "transformpass",  # the pass applying hoisted qk transforms to q and k rows once
        "gradient": "gradpass",  # the pass carrying dQ and dK back through the hoisted transforms
    }
)
"""Every kind of kernel a plan can hold, each with the part of its kernels' names (``attnfuse_<part>_<hash>``).
A plan holds "forward", "decode", "dkdv" and "dq" always, "transform" and "gradient" where its keys' qk
transforms are hoistable."""

ALWAYS_PLANNED = ("forward", "decode", "dkdv", "dq")

DROPOUT_STATE, DROPOUT_P, DROPOUT_SCALE = "DropoutState", "DROPOUT_P", "DROPOUT_SCALE"
"""The parameters of kernels with attention dropout (``KernelConfig.dropout``): the (2,) int64 state tensor (Philox
seed, counter offset), p and 1 / (1 - p) (``passes/codegen/dropout.py``, ``runtime/dropout.py``)."""


def accumulator_type(dtype: str) -> str:
    """The dtype inputs of ``dtype`` accumulate in: "float64" for float64 (for gradcheck), else "float32"."""
    return "float64" if dtype == "float64" else "float32"


@frozen(kw_only=True, cache_hash=True)
class KernelConfig:
    """What besides the program's structure decides its kernels (the compile key): one plan per value."""

    arch: str  # "sm90", "sm80", ... or "interpreter"
    dtype: str  # "float16", "bfloat16", "float32", "float64", or (forward only) "float8_e4m3fn", "float8_e5m2"
    head_dim: int  # D of q and k
    head_dim_v: int  # D of v
    group: int  # Hq // Hkv
    save_lse: bool  # write the log-sum-exp of each row
    fp32_precision: str  # "ieee" or "tf32": how a float32 tl.dot multiplies
    kv_lens: bool = False  # per-sequence key counts (B,): keys past a sequence's count do not exist for it
    paged: bool = False  # k, v are page pools (pages, page_size, Hkv, D) read through a block table
    q_transformed: bool = False  # q arrives with its qk transforms applied (by a transform pass)
    k_transformed: bool = False  # likewise k
    wide_offsets: bool = False  # some element offset can pass 2**31 - 1: every stride is int64 in the kernels
    positions: bool = False  # the call gives its queries' and keys' first positions (Q_OFFSET, K_OFFSET, N_SEQ)
    wide_positions: bool = False  # some position can reach 2**30: positions and the masks' facts are int64
    partial: bool = False  # a partial result over some of each row's keys: the normaliser's ``partial`` fragment
    varlen: bool = False  # packed sequences: q, k rows are documents at cu_seqlens offsets (B = 1), each its own
    dropout: bool = False  # attention dropout: the weights P·V reads are masked by Philox numbers (DROPOUT_P > 0)


@frozen(kw_only=True)
class TemplatePlan:
    """The Hopper template instances of one program (``attnfuse/kernels``): ``kernels``, a spec by kernel kind
    for the kinds the templates can run; ``reasons``, why each other kind runs the generated kernel; the
    program's ``scale`` and its scores' factor in the normaliser's units (``qk_scale``), launch arguments."""

    kernels: dict = field(factory=dict)
    reasons: dict = field(factory=dict)
    scale: float = 1.0
    qk_scale: float = 1.0


@frozen(kw_only=True)
class PluginCall:
    """One combinator application whose plugin gives kernel arguments: ``apply.declaration.prepare`` of
    its parameter values, the tensors and scalars it declares, named ``<prefix>_<name>`` in the kernels."""

    prefix: str
    apply: ir.Apply


@frozen(kw_only=True)
class InputGradient:
    """A runtime argument (``argument``) that parameter ``param`` of combinator ``combinator`` reads. With a
    ``prefix`` (the score modification's application), the dQ kernel can write its score-shaped gradient;
    None: the combinator declares no gradient for it. ``sides``: for a qk transform's (D,) tensor, the
    sides ("q", "k") whose rows give its gradient (``QKTransformFragment.q_tensor_grads``, ``k_tensor_grads``):
    the kernels that carry dQ (the dQ kernel or a gradient pass) and dK (the dK/dV kernel or a gradient pass)
    back through the transforms write (programs, D) partial sums of it; empty for a score-shaped gradient."""

    argument: str
    combinator: str
    param: str
    prefix: str | None
    sides: tuple[str, ...] = ()


@frozen(kw_only=True)
class MaskRange:
    """The ``kv_range`` fact of one mask application as the kernels read it (parameters and ``$self``
    substituted): ``lo`` and ``hi`` bound the keys a query block may keep, with ``$q_lo`` and ``$q_hi`` (the
    block's first and last query positions) still to fill."""

    combinator: str
    lo: str
    hi: str

    def bounds(self, q_lo: str, q_hi: str) -> tuple[str, str]:
        """The (lo, hi) expressions for queries at positions ``q_lo`` to ``q_hi`` (expressions too)."""
        return tuple(string.Template(e).substitute(q_lo=q_lo, q_hi=q_hi) for e in (self.lo, self.hi))


@frozen(kw_only=True, slots=False, eq=False)
class KernelSpec:
    """One generated kernel: what the runtime needs to load and launch it.

    ``scheduled``: its programs follow a listing mask's block order (grid (heads, slots)). ``split_heads``:
    (dK/dV) it splits heavy key blocks over a GQA group's query heads, and takes PartDKV and SplitCount.
    ``halves``: q and k are handled as two halves of the head dim. ``sides``: (passes) the sides it covers.
    ``grad_buffers``: (dQ) the parameters of the score-shaped gradient buffers it writes, in the order of
    its tensor gradients; each takes its strides as ``<buffer>_s<i>``. ``partial_buffers``: (parameter, runtime
    argument) of each (programs, D) buffer of a qk transform tensor's partial gradient sums it writes
    (contiguous, a row per program of its grid, indexed by the linear program id). ``origins``: the distribution of
    each combinator application's plugin, by the prefix that names its fragment in the source.
    """

    kind: str
    name: str
    tiles: TileConfig
    launch: LaunchSpec
    generate: Callable[[str, tuple[Param, ...]], str] = field(repr=False)
    origins: dict[str, str] = field(factory=dict, repr=False)
    scheduled: bool = False
    split_heads: bool = False
    halves: bool = False
    sides: tuple[str, ...] = ()
    grad_buffers: tuple[str, ...] = ()
    partial_buffers: tuple[tuple[str, str], ...] = ()

    @functools.cached_property
    def source(self) -> str:
        """The kernel's Triton source (one undecorated function named ``name``), generated on first use."""
        return self.generate(self.name, self.launch.params)


def _kernels(_, __, kernels: Mapping[str, KernelSpec]) -> None:
    """Every kind a known one, each spec of its kind, and the kernels every plan has there."""
    unknown = sorted(set(kernels) - set(KERNEL_KINDS))
    missing = [kind for kind in ALWAYS_PLANNED if kind not in kernels]
    mislabelled = sorted(kind for kind, spec in kernels.items() if spec.kind != kind)
    if unknown or missing or mislabelled:
        raise ValueError(
            f"Plan.kernels: unknown kinds {unknown} (known: {', '.join(KERNEL_KINDS)}), missing {missing}, "
            f"specs under another kind than theirs {mislabelled}"
        )


@frozen(kw_only=True, slots=False, eq=False)
class Plan:
    """Every kernel of one program for one configuration, and the facts a call needs.

    ``has_lse``: the normaliser keeps a log-sum-exp. ``combine``: how results over disjoint keys merge
    ("logsumexp", "sum"; the split-KV path, a context-parallel ring), or None: no split path. ``partial``:
    the normaliser declares a fragment for results over some of a row's keys (``KernelConfig.partial``
    compiles it), so the split-KV path, which would count its key-independent term in every split, does
    not take it. ``refuses_offsets``: the first combinator with a ``prepare`` that does not declare
    ``takes_offsets`` (a call giving q_offset or k_offset refuses it), or None.
    ``refuses_fp8``: the first combinator whose fragment reads q or k values (a qk transform) and does not
    declare ``runs_on_fp8`` (a float8 call refuses it), or None.
    ``missing_backward``: the combinator declaring no backward (as "the score modification <name>"), or None.
    ``plugin_calls``: the applications whose plugins give kernel
    arguments, in the kernels' order; ``plugin_args``: those arguments' parameter names (tensors, then
    scalars; strides are bound from their tensors). ``block_limit`` and ``heavy_split``: the scalar
    arguments of the listing mask giving its block size (the largest tile) and how many heavy key blocks
    the dK/dV kernel splits over a GQA group's query heads. ``input_gradients``: every runtime input a
    combinator reads. ``mask_ranges``: the ``kv_range`` fact of each mask that declares one, in the
    program's order. ``kernels``: a read-only mapping from kind (``KERNEL_KINDS``) to spec, the dQ kernel
    writing no tensor gradient; ``dq(gradients)`` gives the one writing some. "transform" and "gradient" (the
    passes of hoisted qk transforms) are there when the keys' transforms are hoistable; a hoisted call runs
    the kernels of ``hoisted_config``'s plan between them. ``templates``: the Hopper template instances
    (``attnfuse/kernels``) and why other kinds fall back.
    """

    graph: ir.MatMulPV
    config: KernelConfig
    signature: str
    listing: str
    has_lse: bool
    combine: str | None
    partial: bool
    refuses_offsets: str | None
    missing_backward: str | None
    plugin_calls: tuple[PluginCall, ...]
    plugin_args: tuple[str, ...]
    block_limit: str | None
    heavy_split: str | None
    input_gradients: tuple[InputGradient, ...]
    mask_ranges: tuple[MaskRange, ...]
    kernels: Mapping[str, KernelSpec] = field(converter=lambda k: MappingProxyType(dict(k)), validator=_kernels)
    templates: TemplatePlan = field(factory=TemplatePlan)
    dq_for: Callable[[tuple[InputGradient, ...]], KernelSpec] = field(repr=False)
    refuses_fp8: str | None = None
    with_tensor_grads: Callable[[str, tuple[InputGradient, ...]], KernelSpec] | None = field(default=None, repr=False)

    def dq(self, gradients: tuple[InputGradient, ...] = ()) -> KernelSpec:
        """The dQ kernel, writing the score-shaped gradients of ``gradients`` (of ``input_gradients``), and the
        partial sums of the q side's transform tensor gradients among them."""
        return self.dq_for(gradients) if gradients else self.kernels["dq"]

    def with_partials(self, kind: str, gradients: tuple[InputGradient, ...]) -> KernelSpec:
        """Kernel ``kind`` ("dkdv" or "gradient") writing the partial sums of the qk transforms' tensor
        gradients ``gradients`` (of ``input_gradients``, with ``sides``) its rows give."""
        return self.with_tensor_grads(kind, gradients) if gradients else self.kernels[kind]

    @property
    def hoisted_config(self) -> KernelConfig:
        """The configuration of the kernels that read the passes' transformed copies."""
        transform = self.kernels.get("transform")
        sides = transform.sides if transform is not None else ()
        return attrs.evolve(self.config, **{f"{x}_transformed": x in sides for x in "qk"})
