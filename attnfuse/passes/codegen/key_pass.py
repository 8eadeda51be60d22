"""The key pass: the keys' qk transforms, hoisted out of the forward's key loop.

The forward applies the keys' transforms (rope's rotation) to each key tile it visits, so with many query
blocks every key tile is transformed many times. The key pass transforms each key once into a scratch
copy (B, Hkv, Nk, D) in K's dtype, the values the fused path would cast for its products, and the
forward generated for ``KernelConfig(k_transformed=True)`` reads that copy with no key-side transform.
"""
from __future__ import annotations

import string

from ..lower import TiledKernel
from .common import HEADER, columns, constexpr_args, finish, indent, operand

_KERNEL = string.Template('''\
def $name(
    K, KT,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_tb, stride_th, stride_tn, stride_td,
    HQ, Nq, N_K,$extra_args
    $constexprs
):
    # One program per (key block, batch x kv head): each key's transforms, applied once.
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    HKV = HQ // GROUP
    b = pid_bh // HKV
    hk = pid_bh % HKV
    Nk = N_K
    k_pos = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = k_pos < Nk
$columns    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
$k_load    t_ptrs = (KT + b.to(tl.int64) * stride_tb + hk.to(tl.int64) * stride_th
              + k_pos[:, None] * stride_tn + dh[None, :] * stride_td)
    tl.store(t_ptrs, k1, mask=$store_mask)
    tl.store(t_ptrs + HALF * stride_td, k2, mask=$store_mask)
''')


def generate_key_pass(kernel: TiledKernel) -> str:
    """Triton source of the key pass of a program with key-side qk transforms (contiguous keys, no
    per-sequence lengths)."""
    h_mask = "" if kernel.block_h * 2 == kernel.config.head_dim else " & (dh[None, :] < HALF)"
    return finish(kernel, HEADER.format(what="key pass (hoisted key transforms)", signature=kernel.signature,
                                        listing=kernel.listing) + "\n" + _KERNEL.substitute(
        name=kernel.name.replace("_fwd_", "_keys_"), extra_args="".join(f"\n    {a}," for a in kernel.args()),
        constexprs=constexpr_args(kernel), columns=indent(columns(kernel), 4),
        k_load=indent(operand(kernel, "k", "k_base", "k_pos[:, None] * stride_kn", "k_pos", "k_ok", "stride_kd",
                              True), 4),
        store_mask=f"k_ok[:, None]{h_mask}"))
