"""Rows of a (B, H, N, D) tensor read and written through its pointer, with a TMA descriptor's strides, for
the templates' rare careful paths (their fast paths move tiles through TMA)."""

from __future__ import annotations

from ..triton_compat import gl, gluon


@gluon.jit
def row_offsets(desc, b, h, rows, columns):
    """Element offsets of (rows, columns) at (b, h) of ``desc``'s tensor, by its strides."""
    return (
        b.to(gl.int64) * desc.strides[0]
        + h.to(gl.int64) * desc.strides[1]
        + rows.to(gl.int64) * desc.strides[2]
        + columns
    )


@gluon.jit
def load_rows(
    ptr, desc, b, h, first, n_rows, ROWS_: gl.constexpr, layout: gl.constexpr, C0: gl.constexpr = 0,
    COLUMNS: gl.constexpr = 0,
):  # fmt: skip
    """Rows [first, first + ROWS_) of ``desc``'s tensor at (b, h), columns [C0, C0 + COLUMNS) (all of them by
    default), in ``layout``; rows past n_rows read 0."""
    width: gl.constexpr = COLUMNS if COLUMNS else desc.block_type.shape[3]
    r = gl.expand_dims(first + gl.arange(0, ROWS_, layout=gl.SliceLayout(1, layout)), 1)
    d = gl.expand_dims(C0 + gl.arange(0, width, layout=gl.SliceLayout(0, layout)), 0)
    return gl.load(ptr + row_offsets(desc, b, h, r, d), mask=r < n_rows, other=0.0)


@gluon.jit
def load_rows_t(
    ptr, desc, b, h, first, n_rows, ROWS_: gl.constexpr, layout: gl.constexpr, C0: gl.constexpr = 0,
    COLUMNS: gl.constexpr = 0,
):  # fmt: skip
    """``load_rows`` transposed: (COLUMNS, ROWS_) in ``layout``."""
    width: gl.constexpr = COLUMNS if COLUMNS else desc.block_type.shape[3]
    d = gl.expand_dims(C0 + gl.arange(0, width, layout=gl.SliceLayout(1, layout)), 1)
    r = gl.expand_dims(first + gl.arange(0, ROWS_, layout=gl.SliceLayout(0, layout)), 0)
    return gl.load(ptr + row_offsets(desc, b, h, r, d), mask=r < n_rows, other=0.0)
