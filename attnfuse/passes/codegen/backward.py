"""The backward kernels (FlashAttention-2): weights recomputed tile by tile from the saved log-sum-exp.

``dq`` runs first: one program per (query block, batch x query head) computes its rows' delta =
rowsum(dO ∘ O) − dLSE (stored for the next kernel), accumulates dQ over key blocks, and writes the
score-shaped gradients of tensor inputs (an additive bias). ``dkdv``: one program per (key block, batch x
kv head) accumulates dK and dV over the query blocks that can see it, and over the query heads of its GQA
group, so no two programs write the same rows. The key blocks of a small GQA grid (those that enough query
rows see), and the heavy blocks a listing mask names, take one program per query head instead, and the
group's last to finish sums their shares in head order: results are bitwise identical run to run.
Both loop over the same blocks the forward visits, split the same way into masked and unmasked loops.
The dK/dV kernel computes its scores and dP transposed, (keys, queries), as FlashAttention does, so the
weights and ds enter its products as register operands.
"""

from __future__ import annotations

import string

import attrs

from ...launch_spec import INT, TENSOR, Param, indexed_strides, params, strides
from ..lower import Instance, LoweredProgram
from .common import (
    columns,
    constexpr_params,
    dv_mask,
    fragment,
    half_mask,
    half_offsets,
    kernel_source,
    kv_params,
    masked_load,
    precision,
    qkv_strides,
    split,
)
from .dropout import backward_weights, dropout_setup, dropped_dp, regenerated_keep
from .head_split import LIGHT_BLOCKS, share_sum
from .text import indent
from .loops import HEAD_GROUP, SPLIT_BLOCKS, block_range, key_block, key_range, program, query_block, split_heads, visit
from .operands import (
    key_count,
    key_masked,
    key_offsets,
    key_rows,
    key_shift,
    kv_base,
    operand,
    operand_grad,
    partial_buffer,
    position,
    qk_product,
    query_shift,
)
from .packed import lse_rows
from .scores import has_masks, prologues, scores, with_bounds

DQ_QUERY_ROWS = ("Q", "DO", "O", "DQuery")  # the dQ kernel's row-indexed tensors of q's rows (packed sequences)
DKDV_KEY_ROWS = ("K", "V", "DKey", "DValue")  # the dK/dV kernel's of k's rows

_DKDV = string.Template("""\
    # One program per (key block, batch x kv head): dK, dV of these keys, summed over the group's heads.
$program$key_block$columns    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
$k_load    v = $v_load
$dk_init    dv_acc = tl.zeros([BLOCK_N, BLOCK_DV], dtype=$acc_dtype)
    # Query rows that keep some key of this block (positions k_lo .. k_hi), and those that keep all of it.
    k_lo = $k_lo
    k_hi = $k_hi
$query_range
    full_end = tl.where((pid_n + 1) * BLOCK_N > $n_keys, full_start, full_end)  # a partial key block is never full
$light$loops
$split_reduce    k_in = $k_in
$dk_grad$dk_store    tl.store(DValue + b.to(tl.int64) * stride_dvb + hk.to(tl.int64) * stride_dvh
             + k_idx[:, None] * stride_dvn + dv[None, :] * stride_dvd, dv_acc.to(DValue.dtype.element_ty),
             mask=k_in[:, None]$dv_mask)
""")

_DQ = string.Template("""\
    # One program per (query block, batch x query head): dQ of these rows, over the key blocks they see.
$query_block$q_load    do = $do_load
$rows$prologues$dq_init
$key_range
    k_base = $k_base
    v_base = $v_base
$loops
$dq_grad$dq_store""")


def _rows(kernel: LoweredProgram, masked: bool, compute_delta: bool = False) -> str:
    """Per query tile: the saved row statistics the normaliser's backward reads. ``compute_delta``: the dQ
    kernel computes delta from the tile's dO and O (minus dLSE with HAS_DLSE) and stores it for dK/dV."""
    norm = kernel.normaliser.fragment
    ok = "q_ok" if masked else ""
    code = ""
    if norm.has_lse:
        code += "lse = " + masked_load("Lse + rows + q_idx", ok, other='float("-inf")') + "\n"
    if norm.needs_delta and compute_delta:
        o = masked_load(
            "O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + q_idx[:, None] * stride_om"
            " + dv[None, :] * stride_od",
            "q_ok[:, None]",
            dv_mask(kernel),
        )
        code += (
            f"o = {o}\ndelta = tl.sum(o.to({kernel.accumulator}) * do.to({kernel.accumulator}), 1)\n"
            "if HAS_DLSE:\n    delta -= tl.load(DLse + rows + q_idx, mask=q_ok, other=0.0)\n"
            "tl.store(Delta + rows + q_idx, delta, mask=q_ok)\n"
        )
    elif norm.needs_delta:
        code += f"delta = {masked_load('Delta + rows + q_idx', ok)}\n"
    return code + (fragment(norm.backward_rows) + "\n" if norm.backward_rows else "")


def _recompute(kernel: LoweredProgram, masked: bool, implied: str | None) -> str:
    """Recompute the scores, keeping each modification's input, and the weights ``p``."""
    norm = kernel.normaliser
    code = scores(kernel, masked, rows_too=True, stages=True, implied=implied)
    code += f"# {norm.prefix}: recompute the weights\n{fragment(norm.fragment.recompute)}\n"
    return code


def _chain(kernel: LoweredProgram, masked: bool, write_tensor_grads: bool) -> str:
    """``ds`` from ``dp`` through the normaliser, then back through every modification, last first. A masked
    pair's ds, and its tensor inputs' gradients, are 0: dP = dO·Vᵀ carries a masked key's NaN or inf value
    (its weight is 0, but 0 · NaN is NaN). A row that keeps a non-finite value has a non-finite output,
    hence a non-finite delta and ds, as the math says."""
    norm = kernel.normaliser
    code = f"# {norm.prefix}: gradient of the scores\n{fragment(norm.fragment.grad)}\n"
    mods = kernel.mods
    # a score-shaped buffer spans the call's rows: a packed call's are the packed row's (``lower.packed_rows``)
    rows, keys = ("(q_start + q_idx)", "(k_start + k_idx)") if kernel.config.varlen else ("q_idx", "k_idx")
    for i in reversed(range(len(mods))):
        m = mods[i]
        s_in, s_out = f"s_{i}", f"s_{i + 1}" if i + 1 < len(mods) else "s_nat"
        if write_tensor_grads:
            for name, expr in m.fragment.tensor_grads:
                value = m.code(expr, s_in=s_in, s_out=s_out)
                value = f"tl.where(keep, {value}, 0.0)" if masked else value
                grad = grad_buffer(m, name)
                code += (
                    f"tl.store({grad} + b.to(tl.int64) * {grad}_s0 + h.to(tl.int64) * {grad}_s1 + "
                    f"{rows}[:, None].to(tl.int64) * {grad}_s2 + {keys}[None, :] * {grad}_s3, {value}, "
                    f"mask=in_bounds)\n"
                )
        if m.fragment.grad:
            code += f"# {m.prefix}: gradient through the score modification\n"
            code += fragment(m.code(m.fragment.grad, s_in=s_in, s_out=s_out)) + "\n"
    if masked:
        code += "ds = tl.where(keep, ds, 0.0)\n"
    return code + f"ds = ds * {kernel.scale!r}\n"


def _dkdv_body(kernel: LoweredProgram, masked: bool, implied: str | None) -> str:
    p = precision(kernel)
    ok = "q_ok" if masked else ""
    dtype = "Q.dtype.element_ty"
    q_pos = position(kernel, f"q_idx + {query_shift(kernel)}")
    rows = f"q_idx = start_m + tl.arange(0, BLOCK_M)\nq_pos = {q_pos}\nq_ok = (q_idx < Nq) | EVEN_M\n"
    do_ptrs = "do_base + q_idx[:, None] * stride_dom + dv[None, :] * stride_dod"
    dropped, weights = backward_weights(kernel)
    code = (
        operand(kernel, "q", "q_base", "q_idx[:, None] * stride_qm", "q_pos", "q_ok", "stride_qd", masked)
        + f"do = {masked_load(do_ptrs, f'{ok}[:, None]' if masked else '', dv_mask(kernel))}\n"
        + _rows(kernel, masked)
        + qk_product(kernel, transposed=True)
        + _recompute(kernel, masked, implied)
        + regenerated_keep(kernel)
        + dropped
        + f"dv_acc = tl.dot(tl.trans({weights}.to({dtype})), do, dv_acc{p})\n"
        + f"dp = tl.trans(tl.dot(v, tl.trans(do){p}))\n"
        + dropped_dp(kernel)
        + _chain(kernel, masked, False)
    )
    code += _accumulate(kernel, "dk", f"tl.trans(ds.to({dtype}))", "q")
    return rows + with_bounds(code)


def _dq_body(kernel: LoweredProgram, masked: bool, implied: str | None) -> str:
    masked = key_masked(kernel, masked)
    p = precision(kernel)
    dtype = "Q.dtype.element_ty"
    v = masked_load(
        "v_base + v_off[:, None] + dv[None, :] * stride_vd", "k_ok[:, None]" if masked else "", dv_mask(kernel)
    )
    keys = key_rows(kernel, "start_n") + key_offsets(kernel)
    code = (
        operand(kernel, "k", "k_base", "k_off[:, None]", "k_pos", "k_ok", "stride_kd", masked)
        + f"v = {v}\n"
        + qk_product(kernel)
        + _recompute(kernel, masked, implied)
        + regenerated_keep(kernel)
        + f"dp = tl.dot(do, tl.trans(v){p})\n"
        + dropped_dp(kernel)
        + _chain(kernel, masked, True)
    )
    code += _accumulate(kernel, "dq", f"ds.to({dtype})", "k")
    return keys + with_bounds(code)


def _accumulate(kernel: LoweredProgram, acc: str, weights: str, operand: str) -> str:
    """acc += weights @ operand, on both halves of the head dim when qk transforms split it."""
    p = precision(kernel)
    halves = ("1", "2") if split(kernel) else ("",)
    return "".join(f"{acc}{i} = tl.dot({weights}, {operand}{i}, {acc}{i}{p})\n" for i in halves)


def _accumulators(kernel: LoweredProgram, name: str, rows: str) -> str:
    if split(kernel):
        return (
            f"{name}1 = tl.zeros([{rows}, BLOCK_H], dtype={kernel.accumulator})\n"
            f"{name}2 = tl.zeros([{rows}, BLOCK_H], dtype={kernel.accumulator})\n"
        )
    return f"{name} = tl.zeros([{rows}, BLOCK_D], dtype={kernel.accumulator})\n"


def _store(
    kernel: LoweredProgram, out: str, acc: str, base: str, rows: str, ok: str, stride_row: str, stride_d: str
) -> str:
    if split(kernel):
        h_mask = half_mask(kernel, joined=True)
        first, second = half_offsets(kernel, stride_d)
        ptrs = f"{base} + {rows}[:, None] * {stride_row} + {first}"
        return (
            f"tl.store({ptrs}, {acc}1.to({out}.dtype.element_ty), mask={ok}[:, None]{h_mask})\n"
            f"tl.store({ptrs} + {second}, {acc}2.to({out}.dtype.element_ty), "
            f"mask={ok}[:, None]{h_mask})\n"
        )
    d_mask = "" if kernel.block_d == kernel.config.head_dim else " & (d[None, :] < D)"
    return (
        f"tl.store({base} + {rows}[:, None] * {stride_row} + d[None, :] * {stride_d}, "
        f"{acc}.to({out}.dtype.element_ty), mask={ok}[:, None]{d_mask})\n"
    )


def grad_buffer(inst: Instance, name: str) -> str:
    """The dQ kernel's parameter of the (B, Hq, Nq, Nk) buffer of the gradient of ``inst``'s input ``name``."""
    return f"{inst.prefix}_d{name}"


def _tensor_grad_params(grads: tuple[tuple[Instance, str], ...]) -> tuple[Param, ...]:
    """Each gradient buffer the dQ kernel writes, then its strides."""
    return tuple(
        p
        for inst, name in grads
        for p in (Param(grad_buffer(inst, name), TENSOR), *indexed_strides(grad_buffer(inst, name), 4))
    )


def partial_params(partials: tuple[tuple[Instance, str], ...]) -> tuple[Param, ...]:
    """Each (programs, D) buffer of a transform tensor's partial gradient sums a kernel writes, once each."""
    return params(TENSOR, *dict.fromkeys(partial_buffer(inst, name) for inst, name in partials))


def dkdv_params(kernel: LoweredProgram, partials: tuple[tuple[Instance, str], ...] = ()) -> tuple[Param, ...]:
    """The dK/dV kernel's parameters, in order (PartDKV and SplitCount when it splits heavy key blocks, after
    SPLIT_BLOCKS and SPLIT_ROWS when the runtime says how many blocks, and how many query rows a block needs;
    then the buffers of the k side's transform tensor gradients ``partials``, of ``operands.partial_grads``)."""
    return (
        params(TENSOR, "Q", "K", "V", "DO", "Lse", "Delta", "DKey", "DValue")
        + qkv_strides()
        + strides("do", "bhmd", "DO")
        + strides("dk", "bhnd", "DKey")
        + strides("dv", "bhnd", "DValue")
        + params(INT, "HQ", "Nq", "N_K")
        + kv_params(kernel)
        + kernel.args()
        + (params(INT, SPLIT_BLOCKS, "SPLIT_ROWS") if split_heads(kernel) == SPLIT_BLOCKS else ())
        + (params(TENSOR, "PartDKV", "SplitCount") if split_heads(kernel) is not None else ())
        + partial_params(partials)
        + constexpr_params(kernel, even_keys=True, even_queries=True)
    )


def dq_params(
    kernel: LoweredProgram,
    tensor_grads: tuple[tuple[Instance, str], ...] = (),
    partials: tuple[tuple[Instance, str], ...] = (),
) -> tuple[Param, ...]:
    """The dQ kernel's parameters, in order, with the buffers of the score-shaped gradients it writes, then
    those of the q side's transform tensor gradients ``partials`` (of ``operands.partial_grads``)."""
    return (
        params(TENSOR, "Q", "K", "V", "DO", "O", "Lse", "DLse", "Delta", "DQuery")
        + qkv_strides()
        + strides("do", "bhmd", "DO")
        + strides("o", "bhmd", "O")
        + strides("dq", "bhmd", "DQuery")
        + params(INT, "HQ", "Nq", "N_K", HEAD_GROUP)
        + kv_params(kernel)
        + kernel.args()
        + _tensor_grad_params(tensor_grads)
        + partial_params(partials)
        + constexpr_params(kernel, True, True, "HAS_DLSE")
    )


def generate_dkdv(
    kernel: LoweredProgram, name: str, parameters: tuple[Param, ...], partials: tuple[tuple[Instance, str], ...] = ()
) -> str:
    """Triton source of the dK/dV kernel (one undecorated function ``name`` taking ``parameters``); it also
    writes its partial sums of the k side's transform tensor gradients ``partials``."""
    mask = dv_mask(kernel)
    query_range = (
        block_range(
            kernel, "q_range", "q_full_range", "BLOCK_M", "Nq", query_shift(kernel), {"k_lo": "k_lo", "k_hi": "k_hi"}
        )
        if has_masks(kernel)
        else "start = 0\nhi = Nq\nfull_start = 0\nfull_end = Nq // BLOCK_M * BLOCK_M\n"
    )
    head = (
        "h = hk * GROUP + g\nq_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh\n"
        "do_base = DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh\n"
        f"rows = {lse_rows(kernel, '(b * HQ + h).to(tl.int64)')}\n" + prologues(kernel)
    )
    body = visit(
        kernel,
        lambda masked, implied: _dkdv_body(kernel, masked, implied),
        "start_m",
        "BLOCK_M",
        "pid_n * BLOCK_N",
        transposed=True,
        group_setup=head,
    )
    dk_base = "DKey + b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh"
    splits = split_heads(kernel) is not None
    return kernel_source(
        kernel,
        "dK/dV kernel",
        name,
        parameters,
        _DKDV.substitute(
            acc_dtype=kernel.accumulator,
            split_reduce=indent(share_sum(kernel), 4) if splits else "",
            light=indent(LIGHT_BLOCKS, 4) if split_heads(kernel) == SPLIT_BLOCKS else "",
            k_in=(
                "k_idx < tl.where(last, N_K, 0)  # only the last of a split stores"
                if splits
                else "k_idx < N_K  # rows of keys past a sequence's length get zeros"
            ),
            k_lo=position(kernel, f"pid_n * BLOCK_N + {key_shift(kernel)}"),
            n_keys=key_count(kernel),
            k_hi=position(
                kernel, f"tl.minimum(pid_n * BLOCK_N + BLOCK_N, {key_count(kernel)}) - 1 + {key_shift(kernel)}"
            ),
            columns=indent(columns(kernel) + dropout_setup(kernel), 4),
            key_block=indent(key_block(kernel, even_keys=True), 4),
            program=indent(
                program(kernel, "pid_n", "BLOCK_N", "N_K", transposed=True, moved=(("Q", "DO"), DKDV_KEY_ROWS)), 4
            ),
            k_load=indent(
                operand(kernel, "k", "k_base", "k_idx[:, None] * stride_kn", "k_pos", "k_ok", "stride_kd", True), 4
            ),
            v_load=masked_load(
                "V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh + k_idx[:, None] * "
                "stride_vn + dv[None, :] * stride_vd",
                "k_ok[:, None]",
                mask,
            ),
            dk_init=indent(_accumulators(kernel, "dk", "BLOCK_N"), 4),
            query_range=indent(query_range, 4),
            loops=indent(body, 4),
            dk_grad=indent(operand_grad(kernel, "k", "dk", "k_pos", "k_ok", partials, "k_in"), 4),
            dk_store=indent(_store(kernel, "DKey", "dk", dk_base, "k_idx", "k_in", "stride_dkn", "stride_dkd"), 4),
            dv_mask=f" & {mask}" if mask else "",
        ),
    )


def generate_dq(
    kernel: LoweredProgram,
    name: str,
    parameters: tuple[Param, ...],
    tensor_grads: tuple[tuple[Instance, str], ...] = (),
    partials: tuple[tuple[Instance, str], ...] = (),
) -> str:
    """Triton source of the dQ kernel; it also writes the score-shaped gradients named in ``tensor_grads``,
    and its partial sums of the q side's transform tensor gradients ``partials``."""
    chained = _only(kernel, {(inst.prefix, name) for inst, name in tensor_grads})
    body = visit(
        chained, lambda masked, implied: _dq_body(chained, masked, implied), "start_n", "BLOCK_N", "pid_m * BLOCK_M"
    )
    dq_base = "DQuery + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh"
    do = masked_load(
        "DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh + q_idx[:, None] * "
        "stride_dom + dv[None, :] * stride_dod",
        "q_ok[:, None]",
        dv_mask(kernel),
    )
    return kernel_source(
        kernel,
        "dQ kernel",
        name,
        parameters,
        _DQ.substitute(
            query_block=indent(query_block(kernel, even_queries=True, moved=(DQ_QUERY_ROWS, ("K", "V"))), 4),
            q_load=indent(
                operand(kernel, "q", "q_base", "q_idx[:, None] * stride_qm", "q_pos", "q_ok", "stride_qd", True), 4
            ),
            do_load=do,
            k_base=kv_base(kernel, "k"),
            v_base=kv_base(kernel, "v"),
            rows=indent(
                f"rows = {lse_rows(kernel, 'pid_bh.to(tl.int64)')}\n" + _rows(kernel, True, compute_delta=True), 4
            ),
            prologues=indent(prologues(kernel) + dropout_setup(kernel), 4),
            dq_init=indent(_accumulators(kernel, "dq", "BLOCK_M"), 4),
            key_range=indent(key_range(kernel), 4),
            loops=indent(body, 4),
            dq_grad=indent(operand_grad(kernel, "q", "dq", "q_pos", "q_ok", partials), 4),
            dq_store=indent(_store(kernel, "DQuery", "dq", dq_base, "q_idx", "q_ok", "stride_dqm", "stride_dqd"), 4),
        ),
    )


def _only(kernel: LoweredProgram, wanted: set[tuple[str, str]]) -> LoweredProgram:
    """The kernel with each modification's tensor_grads cut down to the gradients asked for."""
    mods = tuple(
        attrs.evolve(
            m,
            fragment=attrs.evolve(
                m.fragment,
                tensor_grads=tuple(
                    (name, expr) for name, expr in m.fragment.tensor_grads if (m.prefix, name) in wanted
                ),
            ),
        )
        for m in kernel.mods
    )
    return attrs.evolve(kernel, mods=mods)
