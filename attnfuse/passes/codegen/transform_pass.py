"""Transform passes: the qk transforms (rope's rotation), hoisted out of the attention kernels' loops.

Fused, a kernel transforms the tile of its inner loop once per outer block that visits it: the forward
transforms each key tile Nq / BLOCK_M times, the dK/dV kernel each query tile Nk / BLOCK_N times. Hoisted,
``generate_transform_pass`` transforms each row of q or k once into a copy (in the input's dtype: the
values the fused kernels cast for their products), and kernels generated for ``KernelConfig(q_transformed,
k_transformed)`` read the copies with no transform. After a backward on transformed inputs,
``generate_gradient_pass`` carries dQ or dK (float32, with respect to the transformed rows) back through
the transforms' vector-Jacobian products.
"""
from __future__ import annotations

import string

from ..lower import TiledKernel
from .common import HEADER, columns, constexpr_args, finish, indent, key_block, operand, operand_grad

_KERNEL = string.Template('''\
def $name(
    $X, Out,$grad_arg
    stride_${x}b, stride_${x}h, stride_${x}n, stride_${x}d,
    stride_ob, stride_oh, stride_on, stride_od,
    HQ, Nq, N_K,$extra_args
    $constexprs
):
    # One program per (block of rows, batch x head) of $x: each row's transforms, applied once.
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
$rows$columns    ${x}_base = $X + b.to(tl.int64) * stride_${x}b + $head.to(tl.int64) * stride_${x}h
$load$body    o_ptrs = (Out + b.to(tl.int64) * stride_ob + $head.to(tl.int64) * stride_oh
              + ${idx}[:, None] * stride_on + dh[None, :] * stride_od)
    tl.store(o_ptrs, ${result}1.to(Out.dtype.element_ty), mask=$store_mask)
    tl.store(o_ptrs + HALF * stride_od, ${result}2.to(Out.dtype.element_ty), mask=$store_mask)
''')

def _rows(kernel: TiledKernel, x: str) -> str:
    """The program's block of q rows (positions after the keys, bottom-right aligned) or of k rows, and
    its heads (at the k site ``h`` is the group's first query head)."""
    if x == "k":
        return key_block(kernel) + "h = hk * GROUP\n"
    return ("b = pid_bh // HQ\nh = pid_bh % HQ\nhk = h // GROUP\nNk = N_K\n"
            "q_idx = pid_n * BLOCK_M + tl.arange(0, BLOCK_M)\nq_pos = q_idx + (Nk - Nq)\nq_ok = q_idx < Nq\n")


_SITE = {"q": ("q_idx", "q_pos", "q_ok", "h"), "k": ("k_pos", "k_pos", "k_ok", "hk")}  # idx, pos, ok, head


def _generate(kernel: TiledKernel, x: str, gradient: bool) -> str:
    idx, pos, ok, head = _SITE[x]
    h_mask = "" if kernel.block_h * 2 == kernel.config.head_dim else " & (dh[None, :] < HALF)"
    body = ""
    if gradient:
        g = f"G + b.to(tl.int64) * stride_ob + {head}.to(tl.int64) * stride_oh + {idx}[:, None] * stride_on"
        body = (f"g_ptrs = {g} + dh[None, :] * stride_od\n"
                f"g1 = tl.load(g_ptrs, mask={ok}[:, None]{h_mask}, other=0.0)\n"
                f"g2 = tl.load(g_ptrs + HALF * stride_od, mask={ok}[:, None]{h_mask}, other=0.0)\n"
                + operand_grad(kernel, x, "g", pos, ok))
    what = "gradient pass" if gradient else "transform pass"
    return finish(kernel, HEADER.format(what=f"{what} of {x} (hoisted qk transforms)", signature=kernel.signature,
                                        listing=kernel.listing) + "\n" + _KERNEL.substitute(
        name=pass_name(kernel, x, gradient), X=x.upper(), x=x, grad_arg=" G," if gradient else "",
        extra_args="".join(f"\n    {a}," for a in kernel.args()), constexprs=constexpr_args(kernel),
        rows=indent(_rows(kernel, x), 4), columns=indent(columns(kernel), 4), head=head, idx=idx,
        load=indent(operand(kernel, x, f"{x}_base", f"{idx}[:, None] * stride_{x}n", pos, ok, f"stride_{x}d", True),
                    4),
        body=indent(body, 4), result="g" if gradient else x, store_mask=f"{ok}[:, None]{h_mask}"))


def pass_name(kernel: TiledKernel, x: str, gradient: bool = False) -> str:
    return kernel.name.replace("_fwd_", f"_{'d' if gradient else ''}{x}pass_")


def generate_transform_pass(kernel: TiledKernel, x: str) -> str:
    """Triton source that writes the transformed q or k (``x``) rows: (X, Out, strides of both, HQ, Nq,
    N_K, plugin arguments); contiguous rows, no per-sequence lengths."""
    return _generate(kernel, x, gradient=False)


def generate_gradient_pass(kernel: TiledKernel, x: str) -> str:
    """Triton source that turns G, the float32 gradient with respect to the transformed ``x``, into the
    gradient of ``x`` itself: (X, Out, G, strides of X, strides of Out (G has the same), HQ, Nq, N_K,
    plugin arguments)."""
    return _generate(kernel, x, gradient=True)
