"""The forward template's text for float8 q, k, v (``KernelConfig.dtype`` "float8_e4m3fn" or "float8_e5m2"); a
program of another dtype gets the text it always had (``Fp8Text()``), so its instance's source is unchanged.

q·kᵀ multiplies the float8 tiles as they are (``wgmma`` on float8, float32 scores). The entry multiplies the two
scales by q_descale · k_descale of its (batch, kv head), so every score the plugins see is the product of the
dequantised q and k. P·V multiplies P, scaled by ``fp8_pipeline.P_SCALE`` and rounded to e4m3, by Vᵀ's float8
tiles (``fp8_pipeline``), as FlashAttention-3 does but for the scale (small weights keep e4m3's relative
precision). The normaliser's weights are at most 1 (it declares ``unit_weights``, which ``capability`` requires
of a float8 instance), so P · P_SCALE stays within e4m3's range with no check in the key loop.
out is multiplied by v_descale / P_SCALE after the normaliser's finalize (every normaliser is linear in v) and
stored by pointer in the call's ``out_dtype`` (the Q tile, float8, is too narrow to stage it). The careful redo
computes in bfloat16, where float8 values are exact, and multiplies by v_descale alone. A packed call's copy of V
starts each document on a column of its own, and a listed program's loader reads it by the lists' blocks: those
loads are in ``fp8_columns``.
"""

from __future__ import annotations

from attrs import frozen

from ..passes.codegen.fp8 import is_fp8
from ..passes.codegen.loops import listing_mask
from ..passes.lower import LoweredProgram

# P rounds to e4m3 for P·V in both: with e5m2 values, wgmma multiplies e4m3 by e5m2 (QGMMA...E4M3.E5M2)
FP8_TEMPLATE_DTYPES = ("float8_e4m3fn", "float8_e5m2")

_LAYOUTS = """\
    BLOCK_M: gl.constexpr = ROWS
    D: gl.constexpr = q_desc.block_type.shape[3]
    DV: gl.constexpr = v_desc.block_type.shape[2]  # Vᵀ's tiles: [1, 1, DV, BLOCK_N]
    BLOCK_D: gl.constexpr = D
    BLOCK_DV: gl.constexpr = DV
    dtype: gl.constexpr = gl.bfloat16  # the careful redo's products, exact on float8 values"""

_STORE_OUT = """\
o_rows = gl.convert_layout(q_idx, O_ROWS)
d_out = gl.expand_dims(gl.arange(0, DV, layout=gl.SliceLayout(0, O_LAYOUT)), 0)
gl.store(
    Out + row_offsets(o_desc, b, h, gl.expand_dims({first}o_rows, 1), d_out),
    out.to(Out.dtype.element_ty),
    mask=gl.expand_dims(o_rows < Nq, 1),
)"""


@frozen
class Fp8Text:
    """The pieces of a forward instance's text that float8 inputs change; the defaults are every other dtype's."""

    imports: str = ""  # the header's extra imports
    layouts: str | None = None  # the consumers' and careful redo's constants (None: forward._LAYOUTS)
    warpgroup_layout: str = "warpgroup_layout"  # of a consumer's accumulators: its wgmma's instruction shape
    p_width: str = "2"  # P's k_width as a wgmma register operand: 32 bits over its element's
    p_weights: str = "p.to(dtype)"  # the weights P·V takes
    v_view: str = ".reshape([BLOCK_N, DV])"  # a ring stage's V tile as P·V's [BLOCK_N, DV] operand
    dv_axis: str = "3"  # the v descriptor's axis of DV
    upcast: str = ""  # after the careful redo's loads
    load_values: str = "load_rows"  # the careful redo's read of V's rows
    out_dtype: str = "dtype"  # the careful redo's out store
    loader: str = "forward_loader"
    descales: str = ""  # entry code once b and hk are known
    out_descale: str = ""  # after the normaliser's finalize of the consumer's accumulator (P·V of P · P_SCALE)
    careful_out_descale: str = ""  # and of the careful redo's
    store_out: str | None = None  # a consumer's store of its out (None: the facts')


# what a packed or listed program's instance imports besides (``fp8_columns``: V's copy at other columns)
_COLUMNS_IMPORTS = (
    "from attnfuse.kernels.fp8_columns import document_loader_fp8, load_key_block_fp8\n"
    "from attnfuse.kernels.fp8_pipeline import KEY_CHUNK\n"
    "from attnfuse.kernels.listed_pipeline import load_query_tiles  # fp8_columns' loads call it\n"
)


def fp8_text(kernel: LoweredProgram) -> Fp8Text:
    """``kernel``'s float8 text (its dtype's defaults unless float8)."""
    if not is_fp8(kernel):
        return Fp8Text()
    columns = kernel.config.varlen or listing_mask(kernel) is not None

    def descale(tensor: str, prefix: str) -> str:  # of the program's (batch, kv head)
        return f"gl.load({tensor} + b.to(tl.int64) * stride_{prefix}b + hk.to(tl.int64) * stride_{prefix}h)"

    return Fp8Text(
        imports=(
            "from attnfuse.kernels.fp8_pipeline import (\n"
            "    P_SCALE, forward_loader_fp8, fp8_weights, load_value_rows, warpgroup_layout_fp8,\n"
            ")\n"
        )
        + (_COLUMNS_IMPORTS if columns else ""),
        warpgroup_layout="warpgroup_layout_fp8",
        layouts=_LAYOUTS,
        p_width="4",
        p_weights="fp8_weights(p)",
        v_view=".reshape([DV, BLOCK_N]).permute((1, 0))",
        dv_axis="2",
        upcast=".to(gl.float16).to(dtype)",  # by float16: Triton makes e5m2 NaN and Inf finite going to bfloat16
        load_values="load_value_rows",
        out_dtype="Out.dtype.element_ty",
        loader="document_loader_fp8" if kernel.config.varlen else "forward_loader_fp8",
        descales=(
            f"qk_descale = {descale('QDescale', 'qds')} * {descale('KDescale', 'kds')}\n"
            "sm_scale = sm_scale * qk_descale  # float8: the scores of the dequantised q and k\n"
            "qk_scale = qk_scale * qk_descale\n"
        ),
        out_descale=f"out = out * ({descale('VDescale', 'vds')} / P_SCALE)  # float8: the dequantised values'\n",
        careful_out_descale=f"out = out * {descale('VDescale', 'vds')}  # float8: the dequantised values'\n",
        store_out=_STORE_OUT.format(first="q_start + " if kernel.config.varlen else ""),  # a packed call's rows
    )
