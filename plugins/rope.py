"""rope(q, k, theta=10000.0, scale=None, cos=None, sin=None, rotate_keys=True): rotary embedding, then the
scaled product.

NeoX/Llama half-split rotation (HF ``rotate_half``): x·cos + rotate_half(x)·sin, q at its position
q' = i + Nk - Nq and k at j (or where the call's q_offset and k_offset place them). ``cos``/``sin`` tables
of shape (Nk, D) or (B, Nk, D) (seq_len rows with offsets), row = position, as HF builds them, override
``theta`` (so any RoPE scaling works). Fused: the kernel rotates the q tile once
before the key loop and each k tile inside it. ``rotate_keys=False``: the keys were rotated when they were
written to a KV cache, so only q is rotated (the usual choice when decoding from a cache).
"""

from __future__ import annotations

import torch

from attnfuse.plugin import (
    Combinator,
    InputError,
    Param,
    QKTransformFragment,
    Role,
    ScalarArg,
    ScoreSourceFragment,
    TensorArg,
    device_cached,
    finite_number_or_none,
    hookimpl,
    positive_number,
    rotate_half,
)


def _boolean(value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"must be True or False, got {value!r}")


def _theta_angles(positions: torch.Tensor, theta: float, D: int, dtype) -> torch.Tensor:
    """(..., P) positions -> (..., P, D) angles, HF's cat(freqs, freqs)."""
    inv_freq = theta ** (-torch.arange(0, D, 2, dtype=dtype, device=positions.device) / D)
    freqs = positions.to(dtype)[..., None] * inv_freq
    return torch.cat((freqs, freqs), dim=-1)


def _check_tables(cos, sin, ctx):
    if (cos is None) != (sin is None):
        raise InputError("rope: pass both cos and sin, or neither")
    if ctx.D % 2:
        raise InputError(f"rope: the head dim must be even to rotate halves, got D={ctx.D}")
    if cos is None:
        return
    if ctx.q_offset is None and ctx.Nq > ctx.Nk:
        raise InputError(
            f"rope: cos/sin tables are indexed by position, so they need Nq <= Nk "
            f"(got Nq={ctx.Nq}, Nk={ctx.Nk}); pass theta instead"
        )
    rows, what = (ctx.Nk, "Nk") if ctx.q_offset is None else (ctx.seq_len, "seq_len")  # positions lie below it
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise InputError(f"rope: {name} must be a float tensor")
        ok = (
            (t.dim() == 2 or (t.dim() == 3 and t.shape[0] in (1, ctx.B)))
            and t.shape[-2] >= rows
            and t.shape[-1] == ctx.D
        )
        if not ok:
            raise InputError(
                f"rope: {name} must have shape ({what}, D) or (B, {what}, D) = ({rows}, {ctx.D}) or "
                f"({ctx.B}, {rows}, {ctx.D}) (more rows are allowed), got {tuple(t.shape)}"
            )


def reference(q, k, ctx, theta, scale, cos, sin, rotate_keys):
    """Rotate q (B, Hq, Nq, D) and k (B, Hq, Nk, D), then s = q·kᵀ·scale (B, Hq, Nq, Nk)."""
    _check_tables(cos, sin, ctx)
    q_pos, k_pos = ctx.q_pos[:, 0, :, 0], ctx.k_pos[:, 0, 0, :]  # (B or 1, Nq), (1, Nk)
    if cos is not None and (q_pos < 0).any():
        raise InputError(
            "rope: cos/sin tables are indexed by position, so every sequence needs at least Nq keys "
            "(a query at a negative position has no row); pass theta instead"
        )
    if cos is None:

        def table(pos):
            angles = _theta_angles(pos, theta, ctx.D, q.dtype).unsqueeze(1)  # (B or 1, 1, P, D)
            return angles.cos(), angles.sin()
    else:

        def table(pos):
            rows = max(pos.shape[0], cos.shape[0] if cos.dim() == 3 else 1)
            batch = torch.arange(rows, device=pos.device)[:, None]
            c, s = (t if t.dim() == 3 else t[None] for t in (cos, sin))
            pos = pos.expand(rows, -1)
            return (c.expand(rows, -1, -1)[batch, pos].unsqueeze(1), s.expand(rows, -1, -1)[batch, pos].unsqueeze(1))

    (cq, sq), (ck, sk) = table(q_pos), table(k_pos)
    q = q * cq + rotate_half(q) * sq
    if rotate_keys:
        k = k * ck + rotate_half(k) * sk
    scale = ctx.D**-0.5 if scale is None else scale
    return q @ k.transpose(-1, -2) * scale


def _theta_tables(theta: float, first: int, last: int, D: int, B: int, device: torch.device, dtype: torch.dtype):
    """cos and sin (B, last - first, D/2), broadcast over B, for positions first .. last - 1 (both halves
    share them), float32, or float64 for float64 inputs; made once per setting (outside CUDA graph pools)."""

    def make():
        angles = _theta_angles(torch.arange(first, last, device=device), theta, D, torch.float64)[..., : D // 2]
        return tuple(t.to(dtype)[None].expand(B, *t.shape) for t in (angles.cos(), angles.sin()))

    return device_cached(("rope", theta, first, last, D, B, dtype), make, device)


def prepare(ctx, theta, scale, cos, sin, rotate_keys):
    """Tables for q's rotation (``cos``, ``sin``, rows from position ``first``) and for k's (``key_cos``,
    ``key_sin``, from ``key_first``). With theta they cover the positions the call can rotate: below Nk
    without positions (one table for both), the call's queries' and keys' positions with them (a chunk far
    into a long sequence gets tables of its own rows, not of every position before it)."""
    _check_tables(cos, sin, ctx)
    if cos is None:
        dtype = torch.float64 if ctx.dtype == torch.float64 else torch.float32
        if ctx.q_offset is None:
            varied = ctx.kv_lens is not None or ctx.cu_seqlens_q is not None  # sequences of their own lengths
            first = -ctx.Nq if varied else min(0, ctx.Nk - ctx.Nq)  # the lowest query position
            spans = ((first, ctx.Nk),) * 2
        else:
            spans = ((ctx.q_offset, ctx.q_offset + ctx.Nq), (ctx.k_offset, ctx.k_offset + ctx.Nk))
        (q_cos, q_sin), (k_cos, k_sin) = (
            _theta_tables(float(theta), lo, hi, ctx.D, ctx.B, ctx.device, dtype) for lo, hi in spans
        )
        return {
            "cos": q_cos,
            "sin": q_sin,
            "first": spans[0][0],
            "key_cos": k_cos,
            "key_sin": k_sin,
            "key_first": spans[1][0],
        }
    if ctx.kv_lens is not None and bool((ctx.kv_lens < ctx.Nq).any()):  # one host sync, tables only
        raise InputError(
            f"rope: cos/sin tables are indexed by position, so every sequence needs at least "
            f"Nq={ctx.Nq} keys (kv_lens={ctx.kv_lens.tolist()}); pass theta instead"
        )
    if ctx.cu_seqlens_q is not None and bool((ctx.cu_seqlens_k.diff() < ctx.cu_seqlens_q.diff()).any()):  # likewise
        raise InputError(
            "rope: cos/sin tables are indexed by position, so every packed document needs at least as many "
            "keys as queries (cu_seqlens_k's lengths at least cu_seqlens_q's); pass theta instead"
        )
    cos, sin = (t.expand(ctx.B, *t.shape[-2:]) for t in (cos, sin))
    return {"cos": cos, "sin": sin, "first": 0, "key_cos": cos, "key_sin": sin, "key_first": 0}


def examples(draw, shape):
    from hypothesis import strategies as st

    from attnfuse.plugin import random_tensor

    params = {
        "theta": draw(st.sampled_from([10000.0, 500.0])),
        "scale": draw(st.sampled_from([None, 0.2])),
        "cos": None,
        "sin": None,
        "rotate_keys": draw(st.booleans()),
    }
    if shape.Nq <= shape.Nk and draw(st.booleans()):  # arbitrary tables, as a scaled RoPE would build
        angles = random_tensor(draw, draw(st.sampled_from([1, shape.B])), shape.Nk, shape.D // 2) * 3
        angles = torch.cat((angles, angles), dim=-1)
        params.update(cos=angles.cos(), sin=angles.sin())
    return params


def _table(name: str, column: str, first: str) -> str:
    return (
        f"tl.load(${name} + b.to(tl.int64) * ${name}_s0 + ($$pos - ${first})[:, None] * ${name}_s1"
        f" + ({column})[None, :] * ${name}_s2, mask=$$ok & ($$pos >= ${first})[:, None], other=0.0).to($acc_dtype)"
    )


def _rotations(side: str, given: bool) -> tuple[str, str]:
    """(rotate, rotate back) of q or k reading the tables of ``side`` ("" for q's, "key_" for k's)."""
    cos, sin, first = f"{side}cos", f"{side}sin", f"{side}first"
    if not given:
        tables = (
            f"${{tmp}}_cos1 = {_table(cos, 'dh', first)}\n${{tmp}}_sin1 = {_table(sin, 'dh', first)}\n"
            "${tmp}_cos2 = ${tmp}_cos1\n${tmp}_sin2 = ${tmp}_sin1\n"
        )
    else:
        tables = "".join(
            f"${{tmp}}_{t}{i} = {_table(name, col, first)}\n"
            for t, name in (("cos", cos), ("sin", sin))
            for i, col in ((1, "dh"), (2, "dh + HALF"))
        )
    rotate = (
        tables + "${tmp}_x1 = $x1 * ${tmp}_cos1 - $x2 * ${tmp}_sin1\n"
        "$x2 = $x2 * ${tmp}_cos2 + $x1 * ${tmp}_sin2\n$x1 = ${tmp}_x1\n"
    )
    rotate_back = (
        tables + "${tmp}_g1 = $g1 * ${tmp}_cos1 + $g2 * ${tmp}_sin2\n"
        "$g2 = $g2 * ${tmp}_cos2 - $g1 * ${tmp}_sin1\n$g1 = ${tmp}_g1\n"
    )
    return rotate, rotate_back


def fragment(theta, scale, cos, sin, rotate_keys) -> ScoreSourceFragment:
    """x·cos + rotate_half(x)·sin on the halves: x1' = x1·cos1 - x2·sin1, x2' = x2·cos2 + x1·sin2.

    The gradient rotates back (the transpose): g1 <- g1·cos1 + g2·sin2, g2 <- g2·cos2 - g1·sin1.
    With theta, the two halves of the table are equal, so the table holds one (P, D/2); with given
    cos/sin tables (P, D), each half reads its own columns. q reads ``cos``/``sin``, k ``key_cos``/``key_sin``.
    """
    (rotate_q, back_q), (rotate_k, back_k) = (_rotations(side, cos is not None) for side in ("", "key_"))
    return ScoreSourceFragment(
        transform=QKTransformFragment(
            q=rotate_q, k=rotate_k if rotate_keys else "", q_grad=back_q, k_grad=back_k if rotate_keys else None
        )
    )


COMBINATOR = Combinator(
    name="rope",
    role=Role.SCORE_SOURCE,
    doc="Rotary position embedding of q and k (NeoX/Llama half split), then s = q·kᵀ·scale.",
    params=[
        Param(name="theta", default=10000.0, check=positive_number, doc="base of the rotation frequencies"),
        Param(name="scale", default=None, check=finite_number_or_none, doc="None means 1/√D"),
        Param(
            name="cos",
            runtime=True,
            default=None,
            doc="(Nk, D) or (B, Nk, D) table (seq_len rows with offsets); overrides theta",
        ),
        Param(
            name="sin",
            runtime=True,
            default=None,
            doc="(Nk, D) or (B, Nk, D) table (seq_len rows with offsets); overrides theta",
        ),
        Param(
            name="rotate_keys",
            default=True,
            check=_boolean,
            doc="False: keys come rotated already (a RoPE'd KV cache); only q is rotated",
        ),
    ],
    reference=reference,
    tensors=[
        TensorArg(name="cos", rank=3),
        TensorArg(name="sin", rank=3),
        TensorArg(name="key_cos", rank=3),
        TensorArg(name="key_sin", rank=3),
    ],
    scalars=[ScalarArg(name="first"), ScalarArg(name="key_first")],
    prepare=prepare,
    fragment=fragment,
    examples=examples,
    takes_offsets=True,
)


@hookimpl
def attnfuse_combinators():
    return [COMBINATOR]
