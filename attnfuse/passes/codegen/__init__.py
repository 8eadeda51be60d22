"""Pass 3, codegen: a ``LoweredProgram`` -> Triton source, one self-contained function per kernel, and each
kernel's parameters (``*_params``), from which both its ``def`` line and its launch spec are made.

Every variant decision is made here, in Python, so the kernels have no runtime branch on the program's
structure. ``forward`` writes the FlashAttention-2 forward; ``backward`` its two gradient kernels;
``decode`` the split-KV kernel for few queries and long caches; ``transform_pass`` the qk transforms
hoisted out of the kernels' loops, and their gradients.
"""

from .backward import dkdv_params, dq_params, generate_dkdv, generate_dq, grad_buffer
from .common import constants, split
from .decode import decode_params, generate_decode
from .forward import forward_params, generate_forward
from .loops import scheduled, split_heads
from .operands import partial_buffer, partial_grads
from .transform_pass import generate_pass, pass_params

__all__ = [
    "constants",
    "decode_params",
    "dkdv_params",
    "dq_params",
    "forward_params",
    "generate_decode",
    "generate_dkdv",
    "generate_dq",
    "generate_forward",
    "generate_pass",
    "grad_buffer",
    "partial_buffer",
    "partial_grads",
    "pass_params",
    "scheduled",
    "split",
    "split_heads",
]
