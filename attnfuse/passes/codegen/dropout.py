"""Attention dropout in the generated kernels and the Hopper templates (``KernelConfig.dropout``): text emitted
only then, so a kernel without dropout is unchanged.

Each weight of P (B, Hq, Nq, Nk), as the normaliser forms it, is kept where a Philox number ``tl.rand(seed,
counter)`` (written out by ``philox.uniform``, which Gluon runs too) is at least DROPOUT_P, and scaled by
DROPOUT_SCALE = 1 / (1 - DROPOUT_P); the others are zeroed. The counter is the element's index
((b * HQ + h) * Nq + query row) * N_K + key column plus an offset: one number per (batch, query head, query row,
key column), so the backward kernels regenerate the forward's mask exactly and no mask is stored. Seed and
offset are the two int64 values of the call's ``DropoutState`` tensor, read on the device (``runtime/dropout.py``
draws them). The forward masks the weights P·V reads; the backward masks them for
dV = (P ∘ M / (1 - p))ᵀ·dO and masks dP = dO·Vᵀ the same way before the normaliser's gradient, which reads the
unmasked weights.
"""

from __future__ import annotations

from ...launch_spec import CONSTEXPR, INT, SCALAR, TENSOR, Param, params, render_signature
from ...plan import DROPOUT_P as P
from ...plan import DROPOUT_SCALE as SCALE
from ...plan import DROPOUT_STATE as STATE
from ..lower import LoweredProgram
from .philox import uniform


def dropout_params(kernel: LoweredProgram) -> tuple[Param, ...]:
    """The dropout parameters of a kernel with dropout (the state tensor, p and 1 / (1 - p)); none without."""
    return params(TENSOR, STATE) + params(SCALAR, P, SCALE) if kernel.config.dropout else ()


def dropout_setup(kernel: LoweredProgram) -> str:
    """Once per program: the seed and counter offset, read from the state tensor."""
    return _SETUP if kernel.config.dropout else ""


_SETUP = f"drop_seed = tl.load({STATE})\ndrop_offset = tl.load({STATE} + 1)\n"


def keep(packed: bool = False) -> str:
    """``drop_keep`` (BLOCK_M, BLOCK_N) of the tile of rows ``q_idx`` and keys ``k_idx`` of head ``h`` of
    batch ``b``: whether dropout keeps each weight (the text the templates splice too). ``packed``
    (``KernelConfig.varlen``): the rows and keys are a document's (``packed.document``), numbered by their place
    in the packed weights (1, Hq, TOTAL_Q, TOTAL_K), so a call's mask is the one of the packed tensors as a single
    sequence."""
    if packed:
        rows, keys, n_rows, n_keys = "(q_start + q_idx)", "(k_start + k_idx)", "TOTAL_Q", "TOTAL_K"
    else:
        rows, keys, n_rows, n_keys = "q_idx", "k_idx", "Nq", "N_K"
    return (
        f"drop_index = ((b * HQ + h).to(tl.int64) * {n_rows} + {rows}[:, None]) * {n_keys} + {keys}[None, :]"
        " + drop_offset\n"
        + uniform("drop_seed", "drop_index", "drop_rand", temp="drop_philox")
        + f"drop_keep = drop_rand >= {P}\n"
    )


def dropped_weights(kernel: LoweredProgram) -> str:
    """Forward: the weights ``p`` the normaliser formed, masked and scaled for P·V (its own statistics read
    them before)."""
    if not kernel.config.dropout:
        return ""
    kept = keep(kernel.config.varlen)
    return f"# dropout: each weight kept with probability 1 - {P}, scaled by {SCALE}\n{kept}" + (
        f"p = tl.where(drop_keep, p * {SCALE}, 0.0)\n"
    )


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


def dropped_dp(kernel: LoweredProgram) -> str:
    """Backward: dP = dO·Vᵀ is the gradient of the masked, scaled weights; that of the weights themselves is
    it masked and scaled the same way."""
    return f"dp = tl.where(drop_keep, dp * {SCALE}, 0.0)\n" if kernel.config.dropout else ""


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
        + _SETUP
        + keep()
        + "inside = (q_idx[:, None] < Nq) & (k_idx[None, :] < N_K)\n"
        "tl.store(Keep + drop_index - drop_offset, drop_keep.to(tl.int8), mask=inside)\n"
    )
    lines = "".join(f"    {line}\n" for line in body.splitlines())
    return "import triton\nimport triton.language as tl\n\n\n" + render_signature(name, parameters) + lines
