"""Attention dropout in the generated kernels and the Hopper templates (``KernelConfig.dropout``): text emitted
only then, so a kernel without dropout is unchanged.

Each weight of P (B, Hq, Nq, Nk), as the normaliser forms it, is kept where its 16-bit Philox number h has
h / 2**16 >= DROPOUT_P (h >= ``drop_limit`` = ceil(DROPOUT_P * 2**16): p rounded up to a multiple of 2**-16), and
scaled by DROPOUT_SCALE = 1 / (1 - DROPOUT_P); the others are zeroed. A Philox draw, ``tl.randint4x(seed,
counter)`` (written out by ``philox.words``, which Gluon runs too), gives four 32-bit words, eight such numbers:
one draw for a group of eight weights (``keep``); the counter is the index ((b * HQ + h) * Nq + query row) * N_K +
key column of the group's first weight plus an offset, so the backward kernels regenerate the forward's mask
exactly and no mask is stored. Seed and offset are the two int64 values of the call's ``DropoutState`` tensor,
read on the device (``runtime/dropout.py`` draws them). The forward masks the weights P·V reads; the backward
masks them for dV = (P ∘ M / (1 - p))ᵀ·dO and masks dP = dO·Vᵀ the same way before the normaliser's gradient,
which reads the unmasked weights.
"""

from __future__ import annotations

from ...launch_spec import CONSTEXPR, INT, SCALAR, TENSOR, Param, params, render_signature
from ...plan import DROPOUT_P as P
from ...plan import DROPOUT_SCALE as SCALE
from ...plan import DROPOUT_STATE as STATE
from ..lower import LoweredProgram
from .philox import words
from .text import indent


def dropout_params(kernel: LoweredProgram) -> tuple[Param, ...]:
    """The dropout parameters of a kernel with dropout (the state tensor, p and 1 / (1 - p)); none without."""
    return params(TENSOR, STATE) + params(SCALAR, P, SCALE) if kernel.config.dropout else ()


def dropout_setup(kernel: LoweredProgram) -> str:
    """Once per program: the seed and counter offset, read from the state tensor, and ``drop_limit``."""
    return SETUP if kernel.config.dropout else ""


# drop_limit: ceil(p * 2**16), p in float32 as every kernel reads it (the product exact)
SETUP = f"""\
drop_seed = tl.load({STATE})
drop_offset = tl.load({STATE} + 1)
drop_limit = tl.ceil(tl.cast({P}, tl.float32) * 65536.0).to(tl.uint32)
"""


def keep(packed: bool = False, layout: str | None = None) -> str:
    """``drop_keep`` (BLOCK_M, BLOCK_N) of the tile of rows ``q_idx`` and keys ``k_idx`` of head ``h`` of
    batch ``b``: whether dropout keeps each weight. ``packed`` (``KernelConfig.varlen``): the rows and keys are
    a document's (``packed.document``), numbered by their place in the packed weights (1, Hq, TOTAL_Q,
    TOTAL_K), so a call's mask is the one of the packed tensors as a single sequence.

    The weights come in groups of eight, rows i and i + 8 by keys j, j + 1, j + 8 and j + 9 (i with bit 3 clear,
    j with bits 0 and 3 clear), that share one Philox draw (``tl.randint4x``) at the group's first index: weight
    (i + 8a, j + 8c + e) takes half e (0: low, 1: high 16 bits) of the draw's word 2a + c. A tile whose sides are
    multiples of 16 (it then starts at multiples of 16, as every loop's tiles do) draws once per group
    (``_ANCHORS``); on an MMA accumulator's layout a thread holds whole groups, so the numbers stay in its
    registers. ``layout``: the tile's Gluon layout (a name) in a template, whose tiles are such tiles, which the
    numbers return to by a conversion that moves nothing; None in a Triton kernel, whose other tiles draw once per
    weight (``replayed_keep``'s numbers), as packed documents do (they start anywhere in the packed sequence, so
    their tiles cut its groups)."""
    if packed:
        return replayed_keep(packed)
    grouped = _grouped() + _JOIN_KEEP.format(back=_back("drop_keep", layout))
    if layout is not None:
        return _STATIC_ASSERT + grouped
    return (
        "if BLOCK_M % 16 == 0 and BLOCK_N % 16 == 0:  # one Philox draw a group of eight weights\n"
        + indent(grouped, 4)
        + "else:  # one draw a weight, of its group's numbers\n"
        + indent(replayed_keep(), 4)
    )


def replayed_keep(packed: bool = False) -> str:
    """``keep``'s ``drop_keep`` on any tile, a Philox draw per weight (of its group's eight numbers): the replay
    of the mask for the reference (``mask_kernel_source``), packed documents and tiles of other sides."""
    rows, keys, n_rows, n_keys = _NUMBERING[packed]
    draws = _EACH.format(index=_index(f"({rows} & -9)", f"({keys} & -10)", n_rows, n_keys), rows=rows, keys=keys)
    return draws + "drop_keep = drop_number >= drop_limit\n"


def _grouped() -> str:
    """A tile's group draws: ``drop_w0``..``drop_w3`` (BLOCK_M // 16, 8, BLOCK_N // 16, 4), the words of the
    weights (row bit 3, key bit 3) = (0, 0), (0, 1), (1, 0), (1, 1) of each group, key bit 0 the half."""
    return _ANCHORS.format(index=_index(*_NUMBERING[False])) + _DRAWS


# the rows and keys of a tile as the mask numbers them, and their counts: the call's, or the packed sequence's
_NUMBERING = {
    False: ("q_idx", "k_idx", "Nq", "N_K"),
    True: ("(q_start + q_idx)", "(k_start + k_idx)", "TOTAL_Q", "TOTAL_K"),
}


def _index(rows: str, keys: str, n_rows: str, n_keys: str) -> str:
    """The counter tile (BLOCK_M, BLOCK_N) int64 of ``rows`` by ``keys`` (index expressions)."""
    return f"((b * HQ + h).to(tl.int64) * {n_rows} + {rows}[:, None]) * {n_keys} + {keys}[None, :] + drop_offset"


def _back(tile: str, layout: str | None) -> str:
    return tile if layout is None else f"gl.convert_layout({tile}, {layout}, assert_trivial=True)"


_DRAWS = words("drop_seed", "drop_index", ("drop_w0", "drop_w1", "drop_w2", "drop_w3"), temp="drop_philox")

_STATIC_ASSERT = "tl.static_assert(BLOCK_M % 16 == 0 and BLOCK_N % 16 == 0, 'dropout draws for 16 x 16 blocks')\n"

# the tile as 7-d (row / 16, row bit 3, row % 8, key / 16, key bit 3, key % 8 / 2, key bit 0), permuted to
# (row / 16, row % 8, key / 16, key % 8 / 2, key bit 0, row bit 3, key bit 3): splitting the last three off leaves
# each group's first index; the groups' numbers join back in the same places (``_TILE`` undoes the permutation)
_GROUPED = "tl.permute(tl.reshape({}, [BLOCK_M // 16, 2, 8, BLOCK_N // 16, 2, 4, 2]), [0, 2, 3, 5, 6, 1, 4])"

_ANCHORS = f"""\
drop_index = {{index}}
drop_index = {_GROUPED.format("drop_index")}
drop_index = tl.split(tl.split(tl.split(drop_index)[0])[0])[0]
"""

_TILE = "tl.reshape(tl.permute({}, [0, 5, 1, 2, 6, 3, 4]), [BLOCK_M, BLOCK_N])"


def _kept(word: int) -> tuple[str, str]:
    """Whether dropout keeps the weights of word ``word``'s low and high halves (key bit 0 clear, set)."""
    return f"(drop_w{word} & 0xFFFF) >= drop_limit", f"(drop_w{word} >> 16) >= drop_limit"


def _joined_kept(word: int) -> str:
    return "tl.join({}, {})".format(*_kept(word))


_JOIN_KEEP = f"""\
drop_keep = tl.join(tl.join({_joined_kept(0)}, {_joined_kept(2)}), tl.join({_joined_kept(1)}, {_joined_kept(3)}))
drop_keep = {_TILE.format("drop_keep")}
drop_keep = {{back}}
"""

_EACH = f"""\
drop_index = {{index}}
{_DRAWS}\
drop_word = (({{rows}} >> 3) & 1)[:, None] * 2 + (({{keys}} >> 3) & 1)[None, :]
drop_number = tl.where(drop_word < 2, tl.where(drop_word == 0, drop_w0, drop_w1), \\
    tl.where(drop_word == 2, drop_w2, drop_w3))
drop_number = tl.where((({{keys}} & 1) == 1)[None, :], drop_number >> 16, drop_number & 0xFFFF)
"""


def dropped_weights(kernel: LoweredProgram, layout: str | None = None) -> str:
    """Forward: the weights ``p`` the normaliser formed, masked and scaled for P·V (its own statistics read
    them before). ``layout``: as ``keep``'s."""
    if not kernel.config.dropout:
        return ""
    comment = f"# dropout: each weight kept with probability 1 - {P}, scaled by {SCALE}\n"
    return comment + _dropped(kernel, "p", layout)


def _dropped(kernel: LoweredProgram, tile: str, layout: str | None) -> str:
    """``tile`` (BLOCK_M, BLOCK_N) masked by the keep and scaled. In a template (``layout``, a plain call's
    numbering) each group's eight values are dropped as their numbers are drawn (``_JOIN_DROPPED``), so no tile
    of the mask is whole in registers beside ``tile``."""
    if layout is None or kernel.config.varlen:
        return keep(kernel.config.varlen) + f"{tile} = tl.where(drop_keep, {tile} * {SCALE}, 0.0)\n"
    return _STATIC_ASSERT + _grouped() + _JOIN_DROPPED.format(tile=tile, scale=SCALE, back=_back(tile, layout))


def _dropped_word(word: int, tile: str) -> str:
    """``tile``'s weights of word ``word`` (..., key bit 0), masked by its two halves and scaled."""
    low, high = (f"tl.where({kept}, drop_{half} * {{scale}}, 0.0)" for kept, half in zip(_kept(word), ("lo", "hi")))
    return f"drop_lo, drop_hi = tl.split({tile})\n{tile} = tl.join({low}, {high})\n"


# the tile's groups split as the draws' words: drop_t<row bit 3><key bit 3> (..., key bit 0)
_JOIN_DROPPED = f"""\
drop_t = {_GROUPED.format("{tile}")}
drop_t0, drop_t1 = tl.split(drop_t)
drop_t00, drop_t10 = tl.split(drop_t0)
drop_t01, drop_t11 = tl.split(drop_t1)
{"".join(_dropped_word(word, f"drop_t{word >> 1}{word & 1}") for word in range(4))}\
{{tile}} = {_TILE.format("tl.join(tl.join(drop_t00, drop_t10), tl.join(drop_t01, drop_t11))")}
{{tile}} = {{back}}
"""


def regenerated_keep(kernel: LoweredProgram) -> str:
    """Backward, per tile: ``drop_keep``, the forward's mask regenerated."""
    if not kernel.config.dropout:
        return ""
    return f"# dropout: the forward's mask, regenerated\n{keep(kernel.config.varlen)}"


def backward_weights(kernel: LoweredProgram) -> tuple[str, str]:
    """Backward: (code defining the weights dV reads, their name): ``p`` itself without dropout, else
    ``p_drop``, masked and scaled (``p`` stays unmasked for the normaliser's gradient)."""
    if not kernel.config.dropout:
        return "", "p"
    return f"p_drop = tl.where(drop_keep, p * {SCALE}, 0.0)\n", "p_drop"


def dropped_dp(kernel: LoweredProgram, layout: str | None = None) -> str:
    """Backward: dP = dO·Vᵀ is the gradient of the masked, scaled weights; that of the weights themselves is
    it masked and scaled the same way. ``layout`` None: by ``regenerated_keep``'s ``drop_keep``; else (the dQ
    template) drawing the mask here, as the forward template does."""
    if not kernel.config.dropout:
        return ""
    if layout is None:
        return f"dp = tl.where(drop_keep, dp * {SCALE}, 0.0)\n"
    return "# dropout: dP masked and scaled as the forward's weights were\n" + _dropped(kernel, "dp", layout)


def mask_kernel_source(name: str) -> str:
    """Kernel ``name`` writing the keep mask (B, Hq, Nq, N_K) int8 the kernels above use, for the reference: grid
    (B x Hq x row blocks x key blocks,), ``Keep`` contiguous."""
    parameters = (
        params(TENSOR, STATE, "Keep")
        + params(INT, "HQ", "Nq", "N_K")
        + params(SCALAR, P)
        + params(CONSTEXPR, "BLOCK_M", "BLOCK_N")
    )
    body = (
        "pid = tl.program_id(0)\nrow_blocks = tl.cdiv(Nq, BLOCK_M)\nkey_blocks = tl.cdiv(N_K, BLOCK_N)\n"
        "pid_bh = pid // (row_blocks * key_blocks)\nb = pid_bh // HQ\nh = pid_bh % HQ\n"
        "q_idx = pid // key_blocks % row_blocks * BLOCK_M + tl.arange(0, BLOCK_M)\n"
        "k_idx = pid % key_blocks * BLOCK_N + tl.arange(0, BLOCK_N)\n"
        + SETUP
        + replayed_keep()
        + "inside = (q_idx[:, None] < Nq) & (k_idx[None, :] < N_K)\n"
        "element = (pid_bh.to(tl.int64) * Nq + q_idx[:, None]) * N_K + k_idx[None, :]\n"
        "tl.store(Keep + element, drop_keep.to(tl.int8), mask=inside)\n"
    )
    lines = "".join(f"    {line}\n" for line in body.splitlines())
    return "import triton\nimport triton.language as tl\n\n\n" + render_signature(name, parameters) + lines
