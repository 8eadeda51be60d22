"""A program's kernels for one configuration: the runtime's one use of the compiler.

``compiled(graph, config)`` plans the program once (``passes.compiler.compile``) and loads each kernel on its
first use, so a call loads only the kernels it launches (the backward when a gradient is first wanted). Every
call signature that runs the same (graph, config) shares one ``Compiled``: an index of weak references finds
it while some cached call holds it (``launch``), and forgets it when none does.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

from .. import ir
from ..errors import InputError
from ..passes import compiler
from ..plan import KERNEL_KINDS, InputGradient, KernelConfig, Plan
from .backward import BackwardKernels
from .decode import DecodeKernel
from .forward import ForwardKernel
from .hoisted import HoistedBackward, HoistedForward
from .kernel import CompiledKernel


class Compiled:
    """The plan of ``graph`` for ``config`` and its kernels, each built once on first use (threads asking
    for one being built wait for it)."""

    def __init__(self, graph: ir.MatMulPV, config: KernelConfig):
        self.graph, self.config = graph, config
        self._built: dict[Any, Any] = {}
        self._lock = threading.RLock()

    def _once(self, what: Any, build: Callable[[], Any]) -> Any:
        with self._lock:
            value = self._built.get(what)
            if value is None:
                value = self._built[what] = build()
            return value

    @property
    def plan(self) -> Plan:
        return self._once("plan", lambda: compiler.compile(self.graph, self.config))

    @property
    def forward(self) -> ForwardKernel:
        return self._once("forward", lambda: ForwardKernel(self.plan))

    @property
    def decode(self) -> DecodeKernel:
        """The split-KV decoding kernel."""
        return self._once("decode", lambda: DecodeKernel(self.plan))

    def backward(self, gradients: tuple[InputGradient, ...] = ()) -> BackwardKernels:
        """The backward kernels, writing the tensor gradients ``gradients`` too."""
        return self._once(("backward", gradients), lambda: BackwardKernels(self.plan, gradients))

    @property
    def hoisted_kernels(self) -> Compiled:
        """The kernels a hoisted call runs between its passes (those of ``plan.hoisted_config``), kept alive
        with these."""
        return self._once("hoisted kernels", lambda: compiled(self.graph, self.plan.hoisted_config))

    @property
    def hoisted(self) -> HoistedForward:
        """The forward with the qk transforms hoisted into transform passes over q and k."""
        return self._once("hoisted", lambda: HoistedForward(self.forward, self.hoisted_kernels.forward))

    def hoisted_backward(self, gradients: tuple[InputGradient, ...] = ()) -> HoistedBackward:
        """The backward with the qk transforms hoisted into transform and gradient passes."""
        return self._once(
            ("hoisted backward", gradients),
            lambda: HoistedBackward(self.plan, self.hoisted_kernels.backward(gradients), gradients),
        )

    def kernel(self, kind: str) -> CompiledKernel:
        """One generated kernel: ``kind`` is one of ``plan.KERNEL_KINDS``: "forward", "decode" (split-KV),
        "dkdv", "dq", "transform" (the pass that applies the qk transforms to q and k rows once, when the keys
        have some) or "gradient" (the pass carrying dQ and dK back through them)."""
        if kind not in KERNEL_KINDS:
            raise InputError(f"kernel must be one of {', '.join(KERNEL_KINDS)}, got {kind!r}")
        if kind in ("transform", "gradient") and kind not in self.plan.kernels:
            raise InputError(
                f"kernel={kind!r}: this program has no key-side qk transform to hoist (or "
                "reads a cache with kv_lens or pages, where the transform stays in the key loop)"
            )
        if kind == "decode" and self.config.positions:
            raise InputError(
                "kernel='decode': the split-KV kernel places queries bottom-right; a call with "
                "q_offset or k_offset runs the forward kernel"
            )
        kernels = {
            "forward": lambda: self.forward.kernel,
            "decode": lambda: self.decode.kernel,
            "dkdv": lambda: self.backward().dkdv,
            "dq": lambda: self.backward().dq,
            "transform": lambda: self.hoisted.transform.kernel,
            "gradient": lambda: self.hoisted_backward().gradient.kernel,
        }
        return kernels[kind]()


_index: weakref.WeakValueDictionary[tuple, Compiled] = weakref.WeakValueDictionary()
_index_lock = threading.Lock()


def compiled(graph: ir.MatMulPV, config: KernelConfig) -> Compiled:
    """The kernels of ``graph`` for ``config``: the ones in use, or new ones (planned on first use)."""
    key = (graph, config)
    with _index_lock:
        found = _index.get(key)
        if found is None:
            found = _index[key] = Compiled(graph, config)
        return found


def compiled_kernel(graph: ir.MatMulPV, config: KernelConfig, kind: str) -> CompiledKernel:
    """One generated kernel of ``graph`` for ``config`` (``Compiled.kernel``)."""
    return compiled(graph, config).kernel(kind)


def forget() -> None:
    """Forget every program's kernels (calls already holding some keep them)."""
    with _index_lock:
        _index.clear()
