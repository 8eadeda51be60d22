"""The forward kernel of float8 inputs (``KernelConfig.dtype`` "float8_e4m3fn" or "float8_e5m2").

q and k tiles load as float8 and q·kᵀ takes them as they are (a float8 product on sm89 and later, its
partial sums moved to float32 every 32 terms: ``product_keywords``), giving float32 scores, which
``qk_descale`` (q_descale · k_descale of the program's batch and kv head) multiplies before anything else
reads them. P·V takes P, and v upcast, in ``UPCAST_DTYPE``: bfloat16 on a GPU (v's float8 values are exact
there; P keeps 8 significant bits, where float8 e4m3 would keep 4), float16 under Triton's interpreter,
whose bfloat16 products and float32 -> float8 casts compute wrongly (Triton 3.6). q and k halves rewritten
by a qk transform (one that declares ``runs_on_fp8``) go to ``UPCAST_DTYPE`` too. ``out`` is multiplied by
``v_descale`` after the normaliser's ``finalize`` (every normaliser is linear in v).

Descales are float32 (B, Hkv) tensors read through their strides (a per-tensor one is broadcast with
stride 0). Every other dtype's kernel is written as before: each helper here writes nothing for it.
"""

from __future__ import annotations

from ...launch_spec import CONSTEXPR, TENSOR, Param, params, strides
from ..lower import LoweredProgram
from .common import split

FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
UPCAST = "UPCAST_DTYPE"  # constexpr: the dtype of the float8 kernel's products that do not take float8


def is_fp8(kernel: LoweredProgram) -> bool:
    return kernel.config.dtype in FP8_DTYPES


def fp8_params(kernel: LoweredProgram) -> tuple[Param, ...]:
    """The descales, (B, Hkv) each with their strides, for a float8 forward kernel (else none)."""
    if not is_fp8(kernel):
        return ()
    return (
        params(TENSOR, "QDescale", "KDescale", "VDescale")
        + strides("qds", "bh", "QDescale")
        + strides("kds", "bh", "KDescale")
        + strides("vds", "bh", "VDescale")
    )


def fp8_constexprs(kernel: LoweredProgram) -> tuple[Param, ...]:
    return params(CONSTEXPR, UPCAST) if is_fp8(kernel) else ()


def descales(kernel: LoweredProgram) -> str:
    """After the program's batch ``b`` and kv head ``hk`` are known: ``qk_descale`` and ``v_descale``."""
    if not is_fp8(kernel):
        return ""

    def load(tensor: str, prefix: str) -> str:
        return f"tl.load({tensor} + b.to(tl.int64) * stride_{prefix}b + hk.to(tl.int64) * stride_{prefix}h)"

    return (
        "# float8: the descales of this (batch, kv head)\n"
        f"qk_descale = {load('QDescale', 'qds')}\n"
        f"qk_descale = qk_descale * {load('KDescale', 'kds')}\n"
        f"v_descale = {load('VDescale', 'vds')}\n"
    )


def score_descale(kernel: LoweredProgram) -> str:
    """The raw float8 product -> the product of the dequantised q and k."""
    return "s = s * qk_descale\n" if is_fp8(kernel) else ""


PROMOTE_EVERY = 32  # terms of q·kᵀ summed in a float8 product's own accumulator before float32 takes over


def product_keywords(kernel: LoweredProgram) -> str:
    """tl.dot keywords of a float8 q·kᵀ: Hopper's float8 tensor cores sum in an accumulator narrower than
    float32, which Triton by default keeps for the whole product; ``max_num_imprecise_acc`` moves the partial
    sums into float32 every ``PROMOTE_EVERY`` terms (a head dim below that is summed in one step). None for
    other dtypes, nor when qk transforms upcast the halves."""
    if not is_fp8(kernel) or split(kernel) or kernel.block_d < PROMOTE_EVERY:
        return ""
    return f", max_num_imprecise_acc={PROMOTE_EVERY}"


def value_tile(kernel: LoweredProgram, load: str) -> str:
    """The v tile: loaded as it is, or (float8) upcast for P·V by float16 (exact on float8): Triton 3.6 turns
    e5m2 into bfloat16 by moving its bits, which makes NaN and Inf finite; into float16 by a conversion."""
    return f"v = {load}.to(tl.float16).to({UPCAST})\n" if is_fp8(kernel) else f"v = {load}\n"


def weights_dtype(kernel: LoweredProgram) -> str:
    """The dtype P takes for P·V: v's."""
    return UPCAST if is_fp8(kernel) else "V.dtype.element_ty"


def operand_dtype(kernel: LoweredProgram, x: str) -> str:
    """The dtype transformed q or k halves take for q·kᵀ: the input's, or (float8) ``UPCAST_DTYPE``."""
    return UPCAST if is_fp8(kernel) else f"{x.upper()}.dtype.element_ty"


def out_descale(kernel: LoweredProgram) -> str:
    return "out = out * v_descale  # float8: the dequantised values' output\n" if is_fp8(kernel) else ""
