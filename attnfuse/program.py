"""``@af.attention``: a Python function of q, k, v becomes an ``AttentionProgram``."""

from __future__ import annotations

import functools
import inspect
import threading
import types
import warnings
from typing import Any, Callable

import torch

from . import ir
from .combinator import Combinator
from .dsl import RUNTIME, Symbol, trace
from .errors import InputError, ProgramError
from .lru import LRUCache
from .outside_values import OutsideReads, freeze
from .recompile import RecompileWarning, Recompiles
from .reference import check_precision, evaluate
from . import custom_op
from .runtime.launch import run_attention
from .runtime.inputs import check_cache, check_positions, kernel_config
from .runtime.compiled import compiled_kernel
from .runtime.dropout import check_dropout_p, reference_dropout
from .runtime.offsets import inputs_fit
from .runtime.validate import check_call_values
from .runtime.fp8 import FP8_ARGUMENTS
from .runtime.fp8_reference import reference_inputs
from .runtime.packed import reference_packed

RESERVED_ARGUMENTS = (
    "return_lse",
    "kv_lens",
    "block_table",
    "kv_layout",
    "validate",
    "q_offset",
    "k_offset",
    "seq_len",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "max_seqlen_q",
    "max_seqlen_k",
    *FP8_ARGUMENTS,
    "dropout_p",
    "dropout_mask",
)
MAX_TRACES = 64  # graphs kept per program: past RECOMPILE_LIMIT (8) configurations it warns (recompile.py)


def _is_runtime_input(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or getattr(value, "__attnfuse_runtime_input__", False)


def _refuse_method(fn: Callable) -> None:
    """A ProgramError for a method (a function taking ``self`` or ``cls`` first, or a bound method): what it
    reads through ``self`` is not part of the trace key, so a changed attribute would not trace again."""
    name = getattr(fn, "__qualname__", repr(fn))
    if isinstance(fn, types.MethodType):
        first, what = "self", "a bound method"
    else:
        try:
            first = next(iter(inspect.signature(fn).parameters), None)
        except (TypeError, ValueError):
            return
        if first not in ("self", "cls"):
            return
        what = f"it takes {first!r} first"
    raise ProgramError(
        f"@af.attention function {name} is a method ({what}): a program must be a plain function of "
        f"(q, k, v, extra arguments), since values read through {first} would not be part of its trace key. "
        f"Define the program at module level and call it from the method, passing what it needs from {first} "
        f"as arguments: `return my_program(q, k, v, window=self.window)`"
    )


class AttentionProgram:
    """An attention variant, traced once per configuration of its extra arguments.

    Call it as ``program(q, k, v, *extra, return_lse=False)`` with q (B, Hq, Nq, D), k (B, Hkv, Nk, D),
    v (B, Hkv, Nk, DV). Extra tensor (or BlockMask) arguments are runtime inputs; other extra arguments
    are static and part of the trace, as are the values the function reads from closures and globals
    (see ``outside_values``): a new static value, or a changed closure/global value, traces again.
    """

    def __init__(self, fn: Callable):
        _refuse_method(fn)
        params = list(inspect.signature(fn).parameters.values())
        plain = (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.KEYWORD_ONLY,
        )
        if (
            len(params) < 3
            or any(p.kind not in plain for p in params)
            or any(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[:3])
        ):
            raise ProgramError(
                f"@af.attention function {fn.__name__} must take q, k, v as its first three "
                f"arguments, then any named extra arguments (no *args or **kwargs)"
            )
        clash = [p.name for p in params if p.name in RESERVED_ARGUMENTS]
        if clash:
            raise ProgramError(
                f"@af.attention function {fn.__name__}: argument name(s) {clash} are reserved "
                f"for the call ({', '.join(RESERVED_ARGUMENTS)})"
            )
        self.fn = fn
        self._qkv = tuple(p.name for p in params[:3])
        self._extra = tuple((p.name, p.default) for p in params[3:])
        extra_names = {n for n, _ in self._extra}
        # q, k, v bind by position, by the function's own names, or by "q", "k", "v" where no extra takes those
        self._qkv_names = tuple(
            (own,) if alias == own or alias in extra_names else (own, alias)
            for own, alias in zip(self._qkv, ("q", "k", "v"))
        )
        self._qkv_keywords = frozenset(n for names in self._qkv_names for n in names)
        self._outside = OutsideReads(fn, ignored=(AttentionProgram, Combinator))
        self._traces: LRUCache[tuple, ir.MatMulPV] = LRUCache(MAX_TRACES)
        self._tracing = threading.local()  # .active: this thread is running fn on symbols
        self._recompiles = Recompiles(fn.__qualname__, tuple(n for n, _ in self._extra))
        functools.update_wrapper(self, fn)

    def _take_qkv(self, args: tuple, kwargs: dict) -> tuple[tuple, tuple, dict]:
        """Split a call's (q, k, v) from the extra arguments; refuse symbols (a call inside a trace)."""
        if len(args) >= 3 and not (kwargs and self._qkv_keywords & kwargs.keys()):
            qkv, args = args[:3], args[3:]
        else:
            kwargs, values = dict(kwargs), []
            for i, names in enumerate(self._qkv_names):
                given = [n for n in names if n in kwargs]
                if len(given) + (i < len(args)) > 1:
                    raise TypeError(f"{self.fn.__name__}() got argument {names[0]!r} twice")
                if i < len(args):
                    values.append(args[i])
                elif given:
                    values.append(kwargs.pop(given[0]))
                else:
                    raise TypeError(f"{self.fn.__name__}() is missing the argument {names[0]!r}")
            qkv, args = tuple(values), args[3:]
        if any(isinstance(t, Symbol) for t in qkv):
            if getattr(self._tracing, "active", False):
                raise ProgramError(
                    f"{self.fn.__name__} calls itself while it is traced: a program cannot be "
                    f"recursive (it would trace without end)"
                )
            raise ProgramError(
                f"{self.fn.__name__} is called inside another program: programs cannot be called "
                f"inside a program; compose their combinators instead (a plain Python function "
                f"of the scores can share them), or pass values as arguments"
            )
        return qkv, args, kwargs

    def _bind(self, args: tuple, kwargs: dict) -> tuple[tuple, dict[str, Any]]:
        name = self.fn.__name__
        if len(args) > len(self._extra):
            raise TypeError(f"{name}() takes q, k, v and {len(self._extra)} extra argument(s), got {len(args)} extra")
        values = {n: a for (n, _), a in zip(self._extra, args)}
        for n, a in kwargs.items():
            if n in values or n in self._qkv:
                raise TypeError(f"{name}() got argument {n!r} twice")
            if not any(n == e for e, _ in self._extra):
                raise TypeError(f"{name}() got an unexpected argument {n!r}")
            values[n] = a
        statics, inputs = [], {}
        for n, default in self._extra:
            if n not in values:
                if default is inspect.Parameter.empty:
                    raise TypeError(f"{name}() is missing the argument {n!r}")
                values[n] = default
            value = values[n]
            if _is_runtime_input(value):
                inputs[n] = value
                statics.append(RUNTIME)
            else:
                if not ir._static_value(value):
                    raise InputError(
                        f"{name}(): argument {n!r} must be a tensor, a BlockMask, or a static "
                        f"None/bool/int/float/str, got {type(value).__name__}"
                    )
                statics.append(value)
        return tuple(statics), inputs

    def graph(self, *args: Any, **kwargs: Any) -> ir.MatMulPV:
        """The IR graph traced for these extra arguments (static values matter; tensors do not)."""
        return self._trace(self._bind(args, kwargs)[0])

    def _trace(self, statics: tuple) -> ir.MatMulPV:
        """The graph for these static extra arguments (``RUNTIME`` for runtime inputs) and the values the
        function now reads from outside (closures, globals). Keys tell types apart: ``left=2.0`` is not
        the trace of ``left=2``."""
        key = (tuple(s if s is RUNTIME else freeze(s) for s in statics), self._outside.key())
        graph = self._traces.get(key)
        if graph is None:
            if getattr(self._tracing, "active", False):
                raise ProgramError(
                    f"{self.fn.__name__} is traced again while it is being traced: a program "
                    f"cannot use itself (it would trace without end)"
                )
            graph = self._traces.get_or_build(key, lambda: self._new_trace(key, statics))
            message = self._recompiles.warning(lambda name: self._static_only(name, statics))
            if message is not None:
                warnings.warn(message, RecompileWarning, stacklevel=3)
        return graph

    def _static_only(self, name: str, statics: tuple) -> str | None:
        """Why the extra argument ``name`` cannot be a runtime input, found by tracing the program with it as
        one (the other arguments as in ``statics``): None when that trace succeeds."""
        extras = {n: RUNTIME if n == name else value for (n, _), value in zip(self._extra, statics)}
        self._tracing.active = True
        try:
            trace(self.fn, self._qkv, extras)
        except ProgramError as exc:
            return str(exc)
        except Exception as exc:  # the program computes with the value in Python (range(n), math.sqrt(x))
            return f"the program computes with it in Python: {type(exc).__name__}: {exc}"
        finally:
            self._tracing.active = False
        return None

    def _new_trace(self, key: tuple, statics: tuple) -> ir.MatMulPV:
        """Run the function on symbols (once per key: other threads asking for it wait, ``LRUCache``)."""
        extras = {n: value for (n, _), value in zip(self._extra, statics)}
        self._tracing.active = True
        try:
            graph = trace(self.fn, self._qkv, extras)
        finally:
            self._tracing.active = False
        self._recompiles.traced(key[0], key[1:])
        return graph

    def __call__(
        self,
        *args: Any,
        return_lse: bool = False,
        kv_lens: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
        kv_layout: str | None = None,
        validate: bool = True,
        q_offset: int | None = None,
        k_offset: int | None = None,
        seq_len: int | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_k: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None,
        q_descale: torch.Tensor | None = None,
        k_descale: torch.Tensor | None = None,
        v_descale: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
        dropout_p: float = 0,
        **kwargs: Any,
    ):
        """The fused kernel's result: out (B, Hq, Nq, DV), or (out, lse) when ``return_lse``.

        Called as ``program(q, k, v, *extra, **extra)``; q, k, v may also be given by keyword, by the
        function's own parameter names (``query=``) or as ``q=``, ``k=``, ``v=``.
        ``kv_lens`` (B,) int32 or int64: keys per sequence of a KV cache (query i of sequence b at position
        i + kv_lens[b] - Nq). ``block_table`` (B, max_pages) int32 or int64: k and v are a paged cache's
        pools, in ``kv_layout`` "NHD" (pages, page_size, Hkv, D) or "HND" (pages, Hkv, page_size, D); None
        reads "NHD" and refuses a shape both would fit. ``validate`` (default True): check the values of
        kv_lens and block_table on the device, with no host sync (InputError for a negative length or one
        above the capacity, or a used entry outside the pool: raised by the call on CPU, on CUDA by a later
        call or ``attnfuse.check_errors()``); False skips it, and the kernels still read nothing outside the
        cache.
        ``q_offset``, ``k_offset``: the positions of query 0 and key 0 (query i at q_offset + i, key j at
        k_offset + j) in a sequence of ``seq_len`` keys, for a chunk of a longer sequence; under
        torch.compile such a call runs eagerly, outside the graph (the op takes no positions yet). See
        ``cu_seqlens_q``, ``cu_seqlens_k`` (docs + 1,) int32 or int64: packed sequences, q (1, Hq, total_q, D)
        and k, v (1, Hkv, total_k, D) holding documents one after another, each attending within itself at
        positions local to it; ``max_seqlen_q``, ``max_seqlen_k``: optional bounds on their lengths. Under
        torch.compile such a call runs eagerly too.
        ``q_descale``, ``k_descale``, ``v_descale``: float8 q, k, v (torch.float8_e4m3fn or torch.float8_e5m2)
        need them: float32, shape (1,) or (B, Hkv), the factors that dequantise each (FlashAttention-3's);
        ``out_dtype``: a float8 call's output dtype (torch.bfloat16 by default, torch.float16, torch.float32).
        Forward only; under torch.compile such a call runs eagerly. ``dropout_p``: attention dropout (SDPA's
        meaning), a number in [0, 1): each weight zeroed with that probability, the others scaled by
        1 / (1 - p); the call draws its dropout state from the device's default generator. See
        ``attnfuse.run_attention``.
        """
        fp8 = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale, "out_dtype": out_dtype}
        packed = {
            "cu_seqlens_q": cu_seqlens_q,
            "cu_seqlens_k": cu_seqlens_k,
            "max_seqlen_q": max_seqlen_q,
            "max_seqlen_k": max_seqlen_k,
        }
        if torch.compiler.is_compiling():  # one opaque call to Dynamo (see custom_op.opaque_program_call)
            eager = any(a is not None for a in (q_offset, k_offset, seq_len, *packed.values(), *fp8.values()))
            if eager:  # a graph break
                return torch.compiler.disable(self.__call__)(
                    *args,
                    return_lse=return_lse,
                    kv_lens=kv_lens,
                    block_table=block_table,
                    kv_layout=kv_layout,
                    validate=validate,
                    q_offset=q_offset,
                    k_offset=k_offset,
                    seq_len=seq_len,
                    **packed,
                    **fp8,
                    dropout_p=dropout_p,
                    **kwargs,
                )
            hide = custom_op.hide_none
            return custom_op.opaque_program_call(
                self,
                hide(args),
                hide(kwargs),
                return_lse,
                hide(kv_lens),
                hide(block_table),
                validate,
                hide(kv_layout),
                hide(_compiled_rate(dropout_p)),
            )
        # eager: straight to the kernels (the op boundary costs host time that only a compiler needs)
        (q, k, v), args, kwargs = self._take_qkv(args, kwargs)
        statics, inputs = self._bind(args, kwargs) if args or kwargs or self._extra else ((), {})
        return run_attention(
            self._trace(statics),
            q,
            k,
            v,
            inputs,
            return_lse=return_lse,
            kv_lens=kv_lens,
            block_table=block_table,
            validate=validate,
            q_offset=q_offset,
            k_offset=k_offset,
            seq_len=seq_len,
            kv_layout=kv_layout,
            **packed,
            **fp8,
            dropout_p=dropout_p,
        )

    def __eq__(self, other: object) -> bool:  # by identity; defined for torch.compile (a pytree constant)
        return self is other

    __hash__ = object.__hash__

    def reference(
        self,
        *args: Any,
        return_lse: bool = False,
        dtype: torch.dtype = torch.float64,
        kv_lens: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
        kv_layout: str | None = None,
        q_offset: int | None = None,
        k_offset: int | None = None,
        seq_len: int | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_k: torch.Tensor | None = None,
        q_descale: torch.Tensor | None = None,
        k_descale: torch.Tensor | None = None,
        v_descale: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        dropout_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ):
        """The naive PyTorch result computed in ``dtype`` (float64 by default), as the oracle for tests;
        kv_lens and block_table values are checked as a validated call checks them, positions and a paged
        cache's ``kv_layout`` as a call's. Float8 q, k, v are dequantised with their descales (checked as
        a call's) first. With ``dropout_p`` > 0, ``dropout_mask`` (B, Hq, Nq, Nk) bool is the weights dropout
        keeps (a call's: ``attnfuse.dropout_keep``): weights times mask / (1 - p). With ``cu_seqlens_q`` and
        ``cu_seqlens_k`` (checked as a call's, values included), a packed call's: the whole row at once, pairs
        kept within a document, positions restarting in each, tensors indexed by packed rows."""
        check_precision(dtype)
        (q, k, v), args, kwargs = self._take_qkv(args, kwargs)
        packed = reference_packed(q, k, cu_seqlens_q, cu_seqlens_k, kv_lens, block_table, q_offset, k_offset, seq_len)
        paged = block_table  # (a float8 cache's pages are gathered for the reference: it has no table then)
        q, k, v, block_table, kv_layout = reference_inputs(
            q, k, v, q_descale, k_descale, v_descale, dtype, kv_lens, block_table, kv_layout
        )
        layout = check_cache(q, k, v, kv_lens, block_table, kv_layout).kv_layout
        positions = check_positions(q_offset, k_offset, seq_len, q.shape[2], k.shape[2], kv_lens, paged)
        check_call_values(k, kv_lens, block_table, kv_layout=layout, wait=True)
        key, inputs = self._bind(args, kwargs)
        dropout = reference_dropout(dropout_p, dropout_mask, q, k, paged=block_table is not None)
        out, lse = evaluate(
            self._trace(key),
            q,
            k,
            v,
            inputs,
            dtype=dtype,
            kv_lens=kv_lens,
            block_table=block_table,
            positions=positions,
            kv_layout=layout or "NHD",
            dropout=dropout,
            packed=packed,
        )
        if not return_lse:
            return out
        if lse is None:
            raise InputError("return_lse=True needs a normaliser with a log-sum-exp (softmax has one)")
        return out, lse

    def source(
        self,
        *args: Any,
        return_lse: bool = False,
        kernel: str = "forward",
        kv_lens: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
        kv_layout: str | None = None,
        q_offset: int | None = None,
        k_offset: int | None = None,
        seq_len: int | None = None,
        dropout_p: float = 0.0,
        **kwargs: Any,
    ) -> str:
        """The generated Triton source of one kernel for these inputs: ``kernel`` is "forward", "decode"
        (the split-KV path), "dkdv" or "dq" (the backward's), "transform" or "gradient" (the passes of
        hoisted qk transforms): a kind of ``attnfuse.plan.KERNEL_KINDS``; ``dropout_p`` > 0: a call's with
        attention dropout."""
        (q, k, v), args, kwargs = self._take_qkv(args, kwargs)
        kv = check_cache(q, k, v, kv_lens, block_table, kv_layout)._replace(
            positions=check_positions(q_offset, k_offset, seq_len, q.shape[2], k.shape[2], kv_lens, block_table)
        )
        key, inputs = self._bind(args, kwargs)
        graph = self._trace(key)
        save_lse = return_lse or (kernel in ("dkdv", "dq", "gradient") and graph.has_lse)
        config = kernel_config(q, kv, save_lse, not inputs_fit(inputs), check_dropout_p(dropout_p) > 0.0)
        return compiled_kernel(graph, config, kernel).source

    def __repr__(self) -> str:
        return f"<attnfuse program {self.fn.__qualname__}>"


def _compiled_rate(dropout_p: Any) -> float | None:
    """A compiled call's dropout rate for ``_call``, checked; None for none. The default, the int 0, is never
    touched as a float: a float Dynamo sees makes it restart its analysis (one more frame compiled)."""
    if type(dropout_p) is int and dropout_p == 0:
        return None
    return check_dropout_p(dropout_p) or None


def _call(
    program: AttentionProgram,
    args: tuple,
    kwargs: dict,
    return_lse: bool,
    kv_lens: Any,
    block_table: Any,
    validate: bool = True,
    kv_layout: str | None = None,
    dropout_p: float | None = None,
):
    """A program call: bind the arguments, find the trace, run it through ``torch.ops.attnfuse.attention``.
    ``dropout_p``: the checked rate, None for 0; under ``dynamic=True`` Dynamo passes a rate as a symbolic float,
    which ``float`` specialises (a guard: another rate compiles again)."""
    (q, k, v), args, kwargs = program._take_qkv(args, kwargs)
    statics, inputs = program._bind(args, kwargs) if args or kwargs or program._extra else ((), {})
    return custom_op.call(
        program._trace(statics),
        q,
        k,
        v,
        inputs,
        return_lse=return_lse,
        kv_lens=kv_lens,
        block_table=block_table,
        validate=validate,
        kv_layout=kv_layout,
        dropout_p=0.0 if dropout_p is None else float(dropout_p),
    )


custom_op.register_constant(AttentionProgram)
custom_op.PROGRAM_CALL = _call


def attention(fn: Callable) -> AttentionProgram:
    """Decorator: compile an attention program written with AttnFuse combinators.

    >>> @attention
    ... def llama(q, k, v):
    ...     s = rope(q, k)
    ...     s = causal(s)
    ...     return softmax(s) @ v
    """
    return AttentionProgram(fn)
