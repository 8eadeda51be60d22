"""Operand loads: the q and k tiles with their qk transforms (and the transforms' gradients), the
q·kᵀ product, and where a key tile's rows lie in a contiguous or paged cache."""

from __future__ import annotations

from ..lower import Instance, LoweredProgram
from .common import fragment, half_columns, half_mask, half_offsets, masked_load, precision, split, transformed
from .fp8 import operand_dtype, product_keywords

# The row of this program in a (programs, D) partial-sum buffer: its linear id in the launch grid
PARTIAL_ROW = (
    "part_row = (tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * "
    "tl.program_id(2))).to(tl.int64) * D\n"
)


def operand(
    kernel: LoweredProgram, x: str, base: str, rows: str, pos: str, ok: str, stride_d: str, masked: bool
) -> str:
    """Load the q or k tile (row offsets ``rows``, (rows, 1)) and run the qk transforms on it.

    With no transform: one (rows, BLOCK_D) tile ``x``. With transforms: the halves ``x1``, ``x2``
    (rows, BLOCK_H), columns [0, D/2) and [D/2, D) or those of the transforms' column map, transformed in
    float32 and cast back for the products; ``x_in<i>_1``/``_2`` keep each transform's input for the
    backward's vector-Jacobian products.
    Rows a transform pass already transformed (``config.q_transformed``, ``k_transformed``) are only loaded.
    """
    row_mask = f"{ok}[:, None]" if masked else ""
    if not split(kernel):
        d_mask = "" if kernel.block_d == kernel.config.head_dim else "(d[None, :] < D)"
        return f"{x} = {masked_load(f'{base} + {rows} + d[None, :] * {stride_d}', row_mask, d_mask)}\n"
    h_mask = half_mask(kernel)
    fragment_ok = " & ".join(m for m in (f"{ok}[:, None]", h_mask) if m)
    first, second = half_offsets(kernel, stride_d)
    lines = [
        f"{x}_ptrs = {base} + {rows} + {first}",
        f"{x}1f = {masked_load(f'{x}_ptrs', row_mask, h_mask)}.to({kernel.accumulator})",
        f"{x}2f = {masked_load(f'{x}_ptrs + {second}', row_mask, h_mask)}.to({kernel.accumulator})",
    ]
    for i, t in enumerate(kernel.transforms):
        text = getattr(t.fragment, x)
        if text and not transformed(kernel, x):
            lines += [
                f"{x}_in{i}_1 = {x}1f",
                f"{x}_in{i}_2 = {x}2f",
                f"# {t.prefix}: qk transform of {x}",
                fragment(
                    t.code(
                        text,
                        x1=f"{x}1f",
                        x2=f"{x}2f",
                        pos=pos,
                        ok=fragment_ok,
                        tmp=f"{x}_{t.prefix}",
                        **half_columns(kernel),
                    )
                ),
            ]
    lines += [f"{x}1 = {x}1f.to({operand_dtype(kernel, x)})", f"{x}2 = {x}2f.to({operand_dtype(kernel, x)})"]
    return "\n".join(lines) + "\n"


def partial_buffer(inst: Instance, name: str) -> str:
    """The parameter of the (programs, D) buffer of partial sums of the gradient of transform ``inst``'s
    tensor ``name`` (``QKTransformFragment.q_tensor_grads``/``k_tensor_grads``)."""
    return f"{inst.prefix}_d{name}"


def partial_grads(kernel: LoweredProgram, x: str, wanted: set[tuple[str, str]]) -> tuple[tuple[Instance, str], ...]:
    """The (transform, tensor) pairs of side ``x`` whose gradient is ``wanted`` ((prefix, tensor) pairs),
    in the program's order: those whose transform touches ``x`` and declares the tensor's gradient there."""
    return tuple(
        (t, name)
        for t in kernel.transforms
        if getattr(t.fragment, x)
        for name, _ in getattr(t.fragment, f"{x}_tensor_grads")
        if (t.prefix, name) in wanted
    )


def _partial_sums(
    t: Instance, name: str, text: str, site: dict[str, str], rows_ok: str, columns: tuple[str, str]
) -> str:
    """Transform ``t``'s statements ``text`` of its tensor ``name``'s gradient per row, then this program's
    sum of them over its rows (``rows_ok``: (rows,) the rows that exist) stored in its partial buffer, at the
    ``columns`` of the halves (the program's column map)."""
    halves = {f"d{i}": f"{site['tmp']}_{name}_d{i}" for i in (1, 2)}
    buffer = partial_buffer(t, name)
    code = [
        f"# {t.prefix}: this program's sum over its rows of the gradient of its {name}",
        fragment(t.code(text, **site, **halves)),
    ]
    for i, column in enumerate((f"({c})" for c in columns), 1):
        total = f"tl.sum(tl.where({rows_ok}[:, None], {halves[f'd{i}']}, 0.0), 0)"
        code.append(f"tl.store({buffer} + part_row + {column}, {total}.to({buffer}.dtype.element_ty), mask=dh < HALF)")
    return "\n".join(code)


def operand_grad(
    kernel: LoweredProgram,
    x: str,
    grad: str,
    pos: str,
    ok: str,
    partials: tuple[tuple[Instance, str], ...] = (),
    rows_ok: str = "",
) -> str:
    """Run the transforms' vector-Jacobian products, last transform first, on gradient halves
    ``grad1``/``grad2`` (with respect to the transformed ``x``), giving the gradient of the loaded ``x``.
    ``partials`` (of ``partial_grads``): before a transform's product, write this program's partial sum
    of the gradients of its tensors over the rows ``rows_ok`` (``ok`` if empty)."""
    if transformed(kernel, x):  # a gradient pass carries it back through the transforms
        return ""
    h_mask = half_mask(kernel)
    fragment_ok = " & ".join(m for m in (f"{ok}[:, None]", h_mask) if m)
    wanted = {(t.prefix, name) for t, name in partials}
    lines = [PARTIAL_ROW.rstrip("\n")] if partials else []
    for i, t in reversed(list(enumerate(kernel.transforms))):
        text = getattr(t.fragment, f"{x}_grad")
        if getattr(t.fragment, x):
            site = dict(
                g1=f"{grad}1",
                g2=f"{grad}2",
                x1=f"{x}_in{i}_1",
                x2=f"{x}_in{i}_2",
                pos=pos,
                ok=fragment_ok,
                tmp=f"d{x}_{t.prefix}",
                **half_columns(kernel),
            )
            lines += [
                _partial_sums(t, name, code, site, rows_ok or ok, kernel.columns)
                for name, code in getattr(t.fragment, f"{x}_tensor_grads")
                if (t.prefix, name) in wanted
            ]
            lines += [f"# {t.prefix}: gradient through the qk transform of {x}", fragment(t.code(text, **site))]
    return "\n".join(lines) + "\n" if lines else ""


def qk_product(kernel: LoweredProgram, transposed: bool = False) -> str:
    """The raw scores ``s`` = q·kᵀ, (BLOCK_M, BLOCK_N). ``transposed``: computed as (k·qᵀ)ᵀ, for kernels
    whose next products take ``tl.trans`` of the weights (dK/dV): the transposed weights are then already
    in the product's register layout, with no round trip through shared memory."""
    p = precision(kernel) + product_keywords(kernel)
    a, b, out = ("k", "q", "sT") if transposed else ("q", "k", "s")
    if split(kernel):
        code = f"{out} = tl.dot({a}1, tl.trans({b}1){p})\n{out} = tl.dot({a}2, tl.trans({b}2), {out}{p})\n"
    else:
        code = f"{out} = tl.dot({a}, tl.trans({b}){p})\n"
    return code + ("s = tl.trans(sT)\n" if transposed else "")


def kv_length(kernel: LoweredProgram) -> str:
    """``Nk``: the number of keys of sequence ``b`` (the cache's capacity N_K unless lengths are given); a
    length outside [0, N_K] counts as the nearest bound, so no key outside the cache is ever visited. With
    ``positions``, the sequence's length N_SEQ: the call's keys are some of them (``key_count``)."""
    if kernel.config.positions:
        return "Nk = N_SEQ  # the sequence's keys; this call's are N_K of them, from position K_OFFSET\n"
    if kernel.config.kv_lens:
        return "Nk = tl.minimum(tl.maximum(tl.load(KvLens + b), 0), N_K).to(tl.int32)\n"
    return "Nk = N_K\n"


def key_count(kernel: LoweredProgram) -> str:
    """How many keys the call's k holds for this sequence (key indices lie below it): ``Nk``, or with
    ``positions`` (where ``Nk`` is the sequence's length) N_K."""
    return "N_K" if kernel.config.positions else "Nk"


def position(kernel: LoweredProgram, expr: str) -> str:
    """A position (``q_pos``, ``k_pos``, ``q_lo`` ... ``k_hi``) as the kernel keeps it: ``expr`` fits int32,
    but the masks' facts and ``keep`` add window sides to it, so with ``wide_positions`` (positions from
    2**30) it is widened to int64 first (``block_range`` narrows the clamped bounds back)."""
    return f"({expr}).to(tl.int64)" if kernel.config.wide_positions else expr


def query_shift(kernel: LoweredProgram) -> str:
    """Query index -> position: bottom-right aligned, ``(Nk - Nq)``, or the call's Q_OFFSET."""
    return "Q_OFFSET" if kernel.config.positions else "(Nk - Nq)"


def key_shift(kernel: LoweredProgram) -> str:
    """Key index -> position: ``0``, or the call's K_OFFSET."""
    return "K_OFFSET" if kernel.config.positions else "0"


def key_rows(kernel: LoweredProgram, first: str, even_keys: bool = True) -> str:
    """A tile's keys from index ``first``: ``k_idx`` (rows of k and v), ``k_ok`` (constant true with
    ``even_keys`` and EVEN_K) and ``k_pos``, their positions (``k_idx`` plus K_OFFSET with ``positions``)."""
    bound = f"k_idx < {key_count(kernel)}"
    pos = position(kernel, f"k_idx + {key_shift(kernel)}" if kernel.config.positions else "k_idx")
    return (
        f"k_idx = {first} + tl.arange(0, BLOCK_N)\nk_ok = {f'({bound}) | EVEN_K' if even_keys else bound}\n"
        f"k_pos = {pos}\n"
    )


def kv_base(kernel: LoweredProgram, x: str) -> str:
    """The base pointer of k or v rows for (b, hk); a paged cache finds each row's page per tile."""
    batch = "" if kernel.config.paged else f"b.to(tl.int64) * stride_{x}b + "
    return f"{x.upper()} + {batch}hk.to(tl.int64) * stride_{x}h"


def key_offsets(kernel: LoweredProgram) -> str:
    """Per key tile: ``k_off``, ``v_off`` (BLOCK_N,), the offsets of keys ``k_idx`` from ``kv_base``.

    A paged cache's keys on a page outside the pool [0, NUM_PAGES) (a bad block_table entry) are absent:
    ``k_ok`` drops them, so no load touches them and they do not contribute (a paged kernel masks every
    key tile, see ``key_masked``)."""
    if kernel.config.paged:
        return (
            "page = tl.load(BlockTable + b.to(tl.int64) * stride_btb + (k_idx // PAGE_SIZE) * stride_btp, "
            "mask=k_ok, other=-1)\n"
            "k_ok = k_ok & (page >= 0) & (page < NUM_PAGES)  # a page outside the pool: nothing is read\n"
            "page = page.to(tl.int64)\n"
            "k_off = page * stride_kb + (k_idx % PAGE_SIZE) * stride_kn\n"
            "v_off = page * stride_vb + (k_idx % PAGE_SIZE) * stride_vn\n"
        )
    return "k_off = k_idx * stride_kn\nv_off = k_idx * stride_vn\n"


def key_masked(kernel: LoweredProgram, masked: bool) -> bool:
    """Whether a key tile masks its keys: in masked loops, and in every loop of a paged kernel, whose
    ``k_ok`` also drops keys on pages outside the pool (see ``key_offsets``)."""
    return masked or kernel.config.paged
