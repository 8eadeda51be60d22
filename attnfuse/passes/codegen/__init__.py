"""Pass 4, codegen: a ``TiledKernel`` -> Triton source, one self-contained function per kernel.

Every variant decision is made here, in Python, so the kernels have no runtime branch on the program's
structure. ``forward`` writes the FlashAttention-2 forward; ``backward`` its two gradient kernels;
``decode`` the split-KV kernel for few queries and long caches; ``transform_pass`` the qk transforms
hoisted out of the kernels' loops, and their gradients.
"""
from .backward import generate_dkdv, generate_dq
from .decode import generate_decode
from .forward import generate_forward
from .transform_pass import generate_gradient_pass, generate_transform_pass

__all__ = ["generate_decode", "generate_dkdv", "generate_dq", "generate_forward", "generate_gradient_pass",
           "generate_transform_pass"]
