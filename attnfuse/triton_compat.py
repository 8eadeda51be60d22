"""Every private or experimental Triton name AttnFuse uses, in one place.

Checked with Triton 3.6 (3.6.0 on the CPU interpreter, and on an H200), the range ``pyproject.toml`` pins
(``triton>=3.6,<3.7``). These names are not Triton's documented API (``triton.jit``, ``triton.language``,
``triton.cdiv``, ``triton.testing``), so a new Triton may move or change them: a port to one changes this
module, and the modules that use what it changed. ``tests/test_structure.py`` checks that no other module
of the package imports them (the Hopper kernels and the template family included, and the template instances'
generated source imports them from here too).

- the interpreter: ``interpreter`` (the module: ``_patch_lang``, ``_patch_lang_tensor``,
  ``interpreter_builder``), ``InterpretedFunction``, ``InterpreterError``;
- the launcher: ``JITFunction`` (its binder, cache and ``run``), ``driver`` (the active driver's launcher
  and stream), ``knobs`` (the launch hooks, ptxas), ``OutOfResources``;
- Gluon and its Hopper language (``gluon``, ``gl``, ``TensorDescriptor``, ``mma_v2``, ``mbarrier``,
  ``tma``, ``warpgroup_mma``, ``warpgroup_mma_wait``, ``fence_async_shared``, ``builtin``, and
  ``libtriton_ir``, the MLIR builder's module);
- compiling without a GPU: ``ASTSource``, ``GluonASTSource``, ``GPUTarget``, ``BaseBackend``.
"""

from __future__ import annotations

from triton import knobs
from triton._C.libtriton import ir as libtriton_ir
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime import driver, interpreter
from triton.runtime.errors import InterpreterError, OutOfResources
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

__all__ = [
    "ASTSource",
    "BaseBackend",
    "GPUTarget",
    "GluonASTSource",
    "InterpretedFunction",
    "InterpreterError",
    "JITFunction",
    "OutOfResources",
    "TensorDescriptor",
    "builtin",
    "driver",
    "fence_async_shared",
    "gl",
    "gluon",
    "interpreter",
    "knobs",
    "libtriton_ir",
    "mbarrier",
    "mma_v2",
    "tma",
    "warpgroup_mma",
    "warpgroup_mma_wait",
]
