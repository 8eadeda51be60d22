"""rope(q, k, theta=10000.0, scale=None, cos=None, sin=None, rotate_keys=True, rotary_dim=None,
interleaved=False): rotary embedding, then the scaled product.

NeoX/Llama half-split rotation (HF ``rotate_half``): x·cos + rotate_half(x)·sin, q at its position
q' = i + Nk - Nq and k at j (or where the call's q_offset and k_offset place them). ``cos``/``sin`` tables
of shape (Nk, R) or (B, Nk, R) (seq_len rows with offsets; R = rotary_dim, or D), row = position, as HF
builds them, override ``theta`` (so any RoPE scaling works). Fused: the kernel rotates the q tile once
before the key loop and each k tile inside it. ``rotate_keys=False``: the keys were rotated when they were
written to a KV cache, so only q is rotated (the usual choice when decoding from a cache).

``rotary_dim`` (even, at most D): only the first rotary_dim columns rotate, the rest pass through (GPT-NeoX's
rotary_pct, Phi-2, StableLM); its frequencies are theta^(-2i/rotary_dim). ``interleaved``: the pairs
(2i, 2i+1) rotate together, by frequency i (GPT-J, Meta's Llama; HF ``rotate_every_two``). Tables are
always R wide, column c multiplying column c of x: interleaved ones repeat each frequency twice (HF GPT-J's
``repeat_interleave(2)``). The kernels load q and k with these pairs as their two halves (a column map).
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
    rotate_every_two,
    rotate_half,
)


def _boolean(value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"must be True or False, got {value!r}")


def _rotary_dim(value) -> None:
    if value is not None and (type(value) is not int or value <= 0 or value % 2):
        raise ValueError(f"must be None (all of D) or an even int > 0 (the columns that rotate), got {value!r}")


def _theta_angles(positions: torch.Tensor, theta: float, R: int, dtype, interleaved: bool = False) -> torch.Tensor:
    """(..., P) positions -> (..., P, R) angles of the R rotating columns: HF's cat(freqs, freqs), or each
    frequency twice (``interleaved``, HF GPT-J's repeat_interleave(2))."""
    inv_freq = theta ** (-torch.arange(0, R, 2, dtype=dtype, device=positions.device) / R)
    freqs = positions.to(dtype)[..., None] * inv_freq
    return freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)


def _width(ctx, rotary_dim) -> int:
    """R, the columns that rotate: rotary_dim (an InputError if above D), or D."""
    if rotary_dim is None:
        return ctx.D
    if rotary_dim > ctx.D:
        raise InputError(f"rope: rotary_dim={rotary_dim} must be at most the head dim D={ctx.D}")
    return rotary_dim


def _check_tables(cos, sin, ctx, rotary_dim=None, interleaved=False):
    if (cos is None) != (sin is None):
        raise InputError("rope: pass both cos and sin, or neither")
    if ctx.D % 2:
        raise InputError(f"rope: the head dim must be even to rotate halves, got D={ctx.D}")
    R = _width(ctx, rotary_dim)
    if cos is None:
        return
    if ctx.q_offset is None and ctx.Nq > ctx.Nk:
        raise InputError(
            f"rope: cos/sin tables are indexed by position, so they need Nq <= Nk "
            f"(got Nq={ctx.Nq}, Nk={ctx.Nk}); pass theta instead"
        )
    rows, what = (ctx.Nk, "Nk") if ctx.q_offset is None else (ctx.seq_len, "seq_len")  # positions lie below it
    offsets = getattr(ctx, "cu_seqlens_k", None)  # a launch's context has them; the reference's none
    if offsets is not None:  # positions restart in each document: the longest one's keys (a host sync)
        rows, what = int(offsets.diff().max()) if offsets.numel() > 1 else 0, "longest document"
    width = "D" if rotary_dim is None else "rotary_dim"
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise InputError(f"rope: {name} must be a float tensor")
        ok = (t.dim() == 2 or (t.dim() == 3 and t.shape[0] in (1, ctx.B))) and t.shape[-2] >= rows
        if not ok or t.shape[-1] != R:
            hint = ""
            if interleaved and t.dim() in (2, 3) and t.shape[-1] != R:
                hint = (
                    f"; interleaved tables have a column per rotating column, each frequency twice (HF GPT-J's "
                    f"repeat_interleave(2)), so {R} wide, not {t.shape[-1]}"
                )
            raise InputError(
                f"rope: {name} must have shape ({what}, {width}) or (B, {what}, {width}) = ({rows}, {R}) or "
                f"({ctx.B}, {rows}, {R}) (more rows are allowed), got {tuple(t.shape)}{hint}"
            )


def reference(q, k, ctx, theta, scale, cos, sin, rotate_keys, rotary_dim=None, interleaved=False):
    """Rotate the first R columns of q (B, Hq, Nq, D) and k (B, Hq, Nk, D), then s = q·kᵀ·scale (B, Hq, Nq, Nk)."""
    _check_tables(cos, sin, ctx, rotary_dim, interleaved)
    R = _width(ctx, rotary_dim)
    q_pos, k_pos = ctx.q_pos[:, 0, :, 0], ctx.k_pos[:, 0, 0, :]  # (B or 1, Nq), (1, Nk)
    if cos is not None and (q_pos < 0).any():
        raise InputError(
            "rope: cos/sin tables are indexed by position, so every sequence needs at least Nq keys "
            "(a query at a negative position has no row); pass theta instead"
        )
    if cos is None:

        def table(pos):
            angles = _theta_angles(pos, theta, R, q.dtype, interleaved).unsqueeze(1)  # (B or 1, 1, P, R)
            return angles.cos(), angles.sin()
    else:

        def table(pos):
            rows = max(pos.shape[0], cos.shape[0] if cos.dim() == 3 else 1)
            batch = torch.arange(rows, device=pos.device)[:, None]
            c, s = (t if t.dim() == 3 else t[None] for t in (cos, sin))
            pos = pos.expand(rows, -1)
            return (c.expand(rows, -1, -1)[batch, pos].unsqueeze(1), s.expand(rows, -1, -1)[batch, pos].unsqueeze(1))

    rotate = rotate_every_two if interleaved else rotate_half

    def rotated(x, c, s):
        x, passed = x[..., :R], x[..., R:]
        return torch.cat((x * c + rotate(x) * s, passed), dim=-1)

    (cq, sq), (ck, sk) = table(q_pos), table(k_pos)
    q = rotated(q, cq, sq)
    if rotate_keys:
        k = rotated(k, ck, sk)
    scale = ctx.D**-0.5 if scale is None else scale
    return q @ k.transpose(-1, -2) * scale


def _theta_tables(theta: float, first: int, last: int, R: int, B: int, device: torch.device, dtype: torch.dtype):
    """cos and sin (B, last - first, R/2), broadcast over B, for positions first .. last - 1 and the R/2
    frequencies of R rotating columns (a pair's two columns share them), float32, or float64 for float64
    inputs; made once per setting (outside CUDA graph pools)."""

    def make():
        angles = _theta_angles(torch.arange(first, last, device=device), theta, R, torch.float64)[..., : R // 2]
        return tuple(t.to(dtype)[None].expand(B, *t.shape) for t in (angles.cos(), angles.sin()))

    return device_cached(("rope", theta, first, last, R, B, dtype), make, device)


def prepare(ctx, theta, scale, cos, sin, rotate_keys, rotary_dim=None, interleaved=False):
    """Tables for q's rotation (``cos``, ``sin``, rows from position ``first``) and for k's (``key_cos``,
    ``key_sin``, from ``key_first``). With theta they cover the positions the call can rotate: below Nk
    without positions (one table for both), the call's queries' and keys' positions with them (a chunk far
    into a long sequence gets tables of its own rows, not of every position before it)."""
    _check_tables(cos, sin, ctx, rotary_dim, interleaved)
    if cos is None:
        dtype = torch.float64 if ctx.dtype == torch.float64 else torch.float32
        if ctx.q_offset is None:
            varied = ctx.kv_lens is not None or ctx.cu_seqlens_q is not None  # sequences of their own lengths
            first = -ctx.Nq if varied else min(0, ctx.Nk - ctx.Nq)  # the lowest query position
            spans = ((first, ctx.Nk),) * 2
        else:
            spans = ((ctx.q_offset, ctx.q_offset + ctx.Nq), (ctx.k_offset, ctx.k_offset + ctx.Nk))
        (q_cos, q_sin), (k_cos, k_sin) = (
            _theta_tables(float(theta), lo, hi, _width(ctx, rotary_dim), ctx.B, ctx.device, dtype) for lo, hi in spans
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
        "rotary_dim": draw(st.one_of(st.none(), st.integers(1, shape.D // 2).map(lambda i: 2 * i))),
        "interleaved": draw(st.booleans()),
    }
    R = params["rotary_dim"] or shape.D
    if shape.Nq <= shape.Nk and draw(st.booleans()):  # arbitrary tables, as a scaled RoPE would build
        angles = random_tensor(draw, draw(st.sampled_from([1, shape.B])), shape.Nk, R // 2) * 3
        angles = angles.repeat_interleave(2, dim=-1) if params["interleaved"] else torch.cat((angles, angles), dim=-1)
        params.update(cos=angles.cos(), sin=angles.sin())
    return params


def _table(name: str, column: str, first: str, columns_ok: str = "") -> str:
    return (
        f"tl.load(${name} + b.to(tl.int64) * ${name}_s0 + ($$pos - ${first})[:, None] * ${name}_s1"
        f" + ({column})[None, :] * ${name}_s2, mask=$$ok & ($$pos >= ${first})[:, None]{columns_ok}, other=0.0)"
        ".to($acc_dtype)"
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


def _column_map(rotary_dim: int | None, interleaved: bool) -> tuple[str, str]:
    """The columns of the halves' element dh (``QKTransformFragment.columns``): the rotating pairs first,
    (dh, dh + R/2) or interleaved (2·dh, 2·dh + 1) for dh < R/2, then the columns [R, D) that pass through,
    R/2 .. HALF of each half."""
    if rotary_dim is None:  # interleaved, over all of D
        return "2 * dh", "2 * dh + 1"
    R = rotary_dim // 2
    first, second = ("2 * dh", "2 * dh + 1") if interleaved else ("dh", f"dh + {R}")
    return f"tl.where(dh < {R}, {first}, dh + {R})", f"tl.where(dh < {R}, {second}, dh + HALF)"


def _pair_rotations(side: str, given: bool, rotary_dim: int | None) -> tuple[str, str]:
    """(rotate, rotate back) with rotary_dim or interleaved pairs: the halves hold the pairs by the column
    map, so the rotation is the half split's; tables are read at the pair's columns ($col1, $col2; with theta
    one (P, R/2) table by frequency dh), and with rotary_dim the halves' elements from R/2 on pass through."""
    cos, sin, first = f"{side}cos", f"{side}sin", f"{side}first"
    rotating, only = "", ""
    if rotary_dim is not None:
        rotating, only = f"${{tmp}}_rot = (dh < {rotary_dim // 2})[None, :]\n", " & ${tmp}_rot"
    if not given:
        tables = (
            f"${{tmp}}_cos1 = {_table(cos, 'dh', first, only)}\n${{tmp}}_sin1 = {_table(sin, 'dh', first, only)}\n"
            "${tmp}_cos2 = ${tmp}_cos1\n${tmp}_sin2 = ${tmp}_sin1\n"
        )
    else:
        tables = "".join(
            f"${{tmp}}_{t}{i} = {_table(name, f'$col{i}', first, only)}\n"
            for t, name in (("cos", cos), ("sin", sin))
            for i in (1, 2)
        )

    def kept(new: str, old: str) -> str:
        return f"tl.where(${{tmp}}_rot, {new}, {old})" if rotary_dim is not None else new

    rotate = (
        rotating
        + tables
        + f"${{tmp}}_x1 = {kept('$x1 * ${tmp}_cos1 - $x2 * ${tmp}_sin1', '$x1')}\n"
        + f"$x2 = {kept('$x2 * ${tmp}_cos2 + $x1 * ${tmp}_sin2', '$x2')}\n$x1 = ${{tmp}}_x1\n"
    )
    rotate_back = (
        rotating
        + tables
        + f"${{tmp}}_g1 = {kept('$g1 * ${tmp}_cos1 + $g2 * ${tmp}_sin2', '$g1')}\n"
        + f"$g2 = {kept('$g2 * ${tmp}_cos2 - $g1 * ${tmp}_sin1', '$g2')}\n$g1 = ${{tmp}}_g1\n"
    )
    return rotate, rotate_back


def fragment(theta, scale, cos, sin, rotate_keys, rotary_dim=None, interleaved=False) -> ScoreSourceFragment:
    """x·cos + rotate_half(x)·sin on the halves: x1' = x1·cos1 - x2·sin1, x2' = x2·cos2 + x1·sin2.

    The gradient rotates back (the transpose): g1 <- g1·cos1 + g2·sin2, g2 <- g2·cos2 - g1·sin1.
    With theta, the two halves of the table are equal, so the table holds one (P, D/2); with given
    cos/sin tables (P, D), each half reads its own columns. q reads ``cos``/``sin``, k ``key_cos``/``key_sin``.
    With rotary_dim or interleaved, a column map puts each rotating pair in the two halves (``_column_map``).
    """
    if rotary_dim is None and not interleaved:
        (rotate_q, back_q), (rotate_k, back_k) = (_rotations(side, cos is not None) for side in ("", "key_"))
        columns = None
    else:
        (rotate_q, back_q), (rotate_k, back_k) = (
            _pair_rotations(side, cos is not None, rotary_dim) for side in ("", "key_")
        )
        columns = _column_map(rotary_dim, interleaved)
    return ScoreSourceFragment(
        transform=QKTransformFragment(
            q=rotate_q,
            k=rotate_k if rotate_keys else "",
            q_grad=back_q,
            k_grad=back_k if rotate_keys else None,
            columns=columns,
        )
    )


COMBINATOR = Combinator(
    name="rope",
    role=Role.SCORE_SOURCE,
    doc="Rotary position embedding of q and k (NeoX/Llama half split, or GPT-J's interleaved pairs; all of D or "
    "its first rotary_dim columns), then s = q·kᵀ·scale.",
    params=[
        Param(name="theta", default=10000.0, check=positive_number, doc="base of the rotation frequencies"),
        Param(name="scale", default=None, check=finite_number_or_none, doc="None means 1/√D"),
        Param(
            name="cos",
            runtime=True,
            default=None,
            doc="(Nk, R) or (B, Nk, R) table, R = rotary_dim or D (seq_len rows with offsets); overrides theta",
        ),
        Param(
            name="sin",
            runtime=True,
            default=None,
            doc="(Nk, R) or (B, Nk, R) table, R = rotary_dim or D (seq_len rows with offsets); overrides theta",
        ),
        Param(
            name="rotate_keys",
            default=True,
            check=_boolean,
            doc="False: keys come rotated already (a RoPE'd KV cache); only q is rotated",
        ),
        Param(
            name="rotary_dim",
            default=None,
            check=_rotary_dim,
            doc="even, <= D: only the first rotary_dim columns rotate, the rest pass through; None: all of D",
            recorded_at_default=False,
        ),
        Param(
            name="interleaved",
            default=False,
            check=_boolean,
            doc="True: pairs (2i, 2i+1) rotate (GPT-J); False: (i, i + R/2) (NeoX/Llama's rotate_half)",
            recorded_at_default=False,
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
    runs_on_fp8=True,  # a rotation commutes with the descales (a positive factor a head)
)


@hookimpl
def attnfuse_combinators():
    return [COMBINATOR]
