"""Transform passes: the qk transforms (rope's rotation), hoisted out of the attention kernels' loops.

Fused, a kernel transforms the tile of its inner loop once per outer block that visits it: the forward
transforms each key tile Nq / BLOCK_M times, the dK/dV kernel each query tile Nk / BLOCK_N times. Hoisted,
``generate_transform_pass`` transforms each row of q and k once into copies (in the inputs' dtype: the
values the fused kernels cast for their products), in one launch, and kernels generated for
``KernelConfig(q_transformed, k_transformed)`` read the copies with no transform. After a backward on
transformed inputs, ``generate_gradient_pass`` carries dQ and dK (float32, with respect to the transformed
rows) back through the transforms' vector-Jacobian products, in one launch too.
"""

from __future__ import annotations

import string

from ...launch_spec import INT, TENSOR, Param, params, strides
from ..lower import LoweredProgram
from .common import columns, constexpr_params, half_mask, half_offsets, kernel_source
from .text import indent
from .loops import key_block
from .operands import kv_length, operand, operand_grad, partial_buffer, partial_grads, position, query_shift
from .packed import document, packed_params, virtual_blocks

_KERNEL = string.Template("""\
    # A 1-D grid: $layout
    pid = tl.program_id(0)
$sides""")

_SIDE = string.Template("""\
blocks = $blocks
pid_n = $pid % blocks
pid_bh = $pid // blocks
$document$rows$columns${x}_base = $X + b.to(tl.int64) * stride_${x}b + $head.to(tl.int64) * stride_${x}h
$load$body${x}o_ptrs = (${X}Out + b.to(tl.int64) * stride_${x}ob + $head.to(tl.int64) * stride_${x}oh
          + ${idx}[:, None] * stride_${x}on + $offset)
tl.store(${x}o_ptrs, ${result}1.to(${X}Out.dtype.element_ty), mask=$store_mask)
tl.store(${x}o_ptrs + $next_half, ${result}2.to(${X}Out.dtype.element_ty), mask=$store_mask)
""")

_SITE = {"q": ("q_idx", "q_pos", "q_ok", "h"), "k": ("k_idx", "k_pos", "k_ok", "hk")}  # idx, pos, ok, head
_ROWS = {"q": ("Nq", "BLOCK_M"), "k": ("N_K", "BLOCK_N")}  # rows, block


def _rows(kernel: LoweredProgram, x: str) -> str:
    """The program's block of q rows (positions after the keys, bottom-right aligned) or of k rows, and
    its heads (at the k site ``h`` is the group's first query head)."""
    if x == "k":
        return key_block(kernel) + "h = hk * GROUP\n"
    return (
        "b = pid_bh // HQ\nh = pid_bh % HQ\nhk = h // GROUP\n"
        + kv_length(kernel)
        + "q_idx = pid_n * BLOCK_M + tl.arange(0, BLOCK_M)\n"
        + f"q_pos = {position(kernel, f'q_idx + {query_shift(kernel)}')}\n"
        "q_ok = q_idx < Nq\n"
    )


def _document(kernel: LoweredProgram, x: str, gradient: bool) -> str:
    """Packed sequences: block ``pid_n`` of side ``x`` taken to its document (``codegen/packed.py``), its rows'
    pointers moved to the document's first row; from there on the program is one of a single sequence."""
    if not kernel.config.varlen:
        return ""
    X, block = x.upper(), _ROWS[x][1]
    moves = [f"{X} += {x}_start.to(tl.int64) * stride_{x}n\n"] + [
        f"{p} += {x}_start.to(tl.int64) * stride_{x}on\n" for p in (f"{X}Out", f"G{X}")[: 1 + gradient]
    ]
    return document("pid_n", block, x, (), ()) + "".join(moves)


def _side(kernel: LoweredProgram, x: str, first: str, gradient: bool, wanted: set[tuple[str, str]]) -> str:
    """One side's program body; its programs start at ``first`` in the grid. ``wanted``: the (transform
    prefix, tensor) pairs whose gradients' partial sums a gradient pass writes."""
    idx, pos, ok, head = _SITE[x]
    rows_n, block = _ROWS[x]
    h_mask = half_mask(kernel, joined=True)
    offset, next_half = half_offsets(kernel, f"stride_{x}od")
    body = ""
    if gradient:
        g = (
            f"G{x.upper()} + b.to(tl.int64) * stride_{x}ob + {head}.to(tl.int64) * stride_{x}oh"
            f" + {idx}[:, None] * stride_{x}on"
        )
        body = (
            f"g_ptrs = {g} + {offset}\n"
            f"g1 = tl.load(g_ptrs, mask={ok}[:, None]{h_mask}, other=0.0)\n"
            f"g2 = tl.load(g_ptrs + {next_half}, mask={ok}[:, None]{h_mask}, other=0.0)\n"
            + operand_grad(kernel, x, "g", pos, ok, partial_grads(kernel, x, wanted))
        )
    return _SIDE.substitute(
        blocks=virtual_blocks(block, rows_n) if kernel.config.varlen else f"tl.cdiv({rows_n}, {block})",
        pid=f"(pid - {first})" if first != "0" else "pid",
        document=_document(kernel, x, gradient),
        rows=_rows(kernel, x),
        columns=columns(kernel),
        x=x,
        X=x.upper(),
        head=head,
        idx=idx,
        load=operand(kernel, x, f"{x}_base", f"{idx}[:, None] * stride_{x}n", pos, ok, f"stride_{x}d", True),
        body=body,
        result="g" if gradient else x,
        store_mask=f"{ok}[:, None]{h_mask}",
        offset=offset,
        next_half=next_half,
    )


def pass_params(
    kernel: LoweredProgram, sides: tuple[str, ...], gradient: bool, wanted: set[tuple[str, str]] = frozenset()
) -> tuple[Param, ...]:
    """A pass's parameters: each side's X, then each XOut (then each GX: ``gradient``), the strides of each
    X then of each XOut (GX has XOut's), HQ, Nq, N_K, BATCH, the plugins' arguments, then (a gradient pass)
    the (programs, D) buffers of the transforms' tensor gradients ``wanted`` ((prefix, tensor) pairs), one
    row per program of the whole launch."""
    partials = dict.fromkeys(partial_buffer(t, n) for x in sides for t, n in partial_grads(kernel, x, wanted))
    pointers = [x.upper() for x in sides] + [f"{x.upper()}Out" for x in sides]
    pointers += [f"G{x.upper()}" for x in sides] if gradient else []
    owners = [(x, x.upper()) for x in sides] + [(f"{x}o", f"{x.upper()}Out") for x in sides]  # (prefix, tensor)
    return (
        params(TENSOR, *pointers)
        + tuple(p for prefix, owner in owners for p in strides(prefix, "bhnd", owner))
        + params(INT, "HQ", "Nq", "N_K", "BATCH")
        + (params(INT, "Q_OFFSET", "K_OFFSET", "N_SEQ") if kernel.config.positions else ())
        + packed_params(kernel)
        + kernel.args()
        + params(TENSOR, *partials)
        + constexpr_params(kernel)
    )


def generate_pass(
    kernel: LoweredProgram,
    name: str,
    parameters: tuple[Param, ...],
    sides: tuple[str, ...],
    gradient: bool,
    wanted: set[tuple[str, str]] = frozenset(),
) -> str:
    """The pass over ``sides`` ("q", "k" or both; with both, q's programs come first, then k's): it writes
    the transformed rows (contiguous rows, no per-sequence lengths; grid: one program per block of rows,
    BLOCK_M of q, BLOCK_N of k, per batch and head of each side; packed sequences: per head, the blocks of
    ``packed.virtual_blocks``, each of one document, at the document's positions), or with ``gradient``
    turns GX, the float32 gradient with respect to each transformed side X, into the gradient of X itself,
    XOut, and writes the partial sums of the transforms' tensor gradients ``wanted`` ((prefix, tensor) pairs)."""
    if sides == ("q", "k"):
        q_blocks = virtual_blocks("BLOCK_M", "Nq") if kernel.config.varlen else "tl.cdiv(Nq, BLOCK_M)"
        q_programs = f"{q_blocks} * BATCH * HQ"
        code = (
            f"q_programs = {q_programs}\nif pid >= q_programs:\n"
            + indent(_side(kernel, "k", "q_programs", gradient, wanted), 4)
            + "    return\n"
            + _side(kernel, "q", "0", gradient, wanted)
        )
        layout = "(block of q rows, batch x head) programs first, then (block of k rows, batch x kv head)."
    else:
        [x] = sides
        code = _side(kernel, x, "0", gradient, wanted)
        layout = f"one program per (block of {x} rows, batch x {'head' if x == 'q' else 'kv head'})."
    what = "gradient pass" if gradient else "transform pass"
    return kernel_source(
        kernel,
        f"{what} of {' and '.join(sides)} (hoisted qk transforms)",
        name,
        parameters,
        _KERNEL.substitute(layout=layout, sides=indent(code, 4)),
    )
