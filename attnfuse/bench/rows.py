"""Result rows: one case of a suite, each contender's median ms, and the JSON form of a whole run.

The suites build every row with the ``*_row`` functions here (the case's label and its work: FLOPs of
the (query, key) pairs kept, or bytes of K and V read), then fill in ``times`` and ``err``.
"""

from __future__ import annotations

import json

import attrs
from attrs import define, field

from .cases import DECODE_MODELS, GEOMETRIES, PER_TILE, pairs

# Contenders in table order: key -> column title
CONTENDERS = {
    "attnfuse": "AttnFuse",
    "fa2_triton": "FA2 Triton (hand-written)",
    "cudnn": "cuDNN SDPA",
    "flash": "FA2 SDPA",
    "flex": "flex (compiled)",
    "fa_varlen": "FlashAttention varlen",
    "fa3_fp8": "FlashAttention-3 fp8",
}
TRAINING_FLOPS = 3.5  # forward + backward, relative to the forward's 4·pairs·D per head
# a Row per case (memory and overhead: lines)
TABLE_SUITES = ("forward", "backward", "decode", "sparse", "packed", "fp8", "dropout")
SUITE_TITLES = {
    "forward": "Forward",
    "backward": "Forward + backward",
    "decode": "Decoding (one query per sequence, full cache)",
    "sparse": "Block-sparse (BigBird)",
    "packed": "Packed documents (varlen)",
    "fp8": "Float8 forward (e4m3 and e5m2, baselines in bfloat16)",
    "dropout": "Forward + backward with attention dropout",
    "memory": "Memory",
    "overhead": "Host overhead",
}


@define(kw_only=True)
class Row:
    """One case: ``times`` maps a CONTENDERS key to its median ms, or to "n/a (reason)" where it cannot
    run; ``err`` is the max abs difference of AttnFuse's result from a baseline's on the same inputs."""

    suite: str
    case: str
    work: float  # FLOPs (unit "TFLOP/s") or bytes read (unit "GB/s")
    unit: str
    geometry: str | None = None
    variant: str | None = None
    N: int | None = None
    times: dict[str, float | str] = field(factory=dict)
    err: float | None = None

    def rate(self, ms: float) -> float:
        """TFLOP/s or GB/s at ``ms`` milliseconds."""
        return self.work / ms / (1e9 if self.unit == "TFLOP/s" else 1e6)

    def ratio(self, contender: str) -> float | None:
        """The contender's time over AttnFuse's, where both ran."""
        theirs, ours = self.times.get(contender), self.times.get("attnfuse")
        return theirs / ours if isinstance(theirs, float) and isinstance(ours, float) else None


def forward_row(geometry: str, N: int, variant: str) -> Row:
    B, Hq, _, D = GEOMETRIES[geometry]
    kept = pairs("rope_causal" if variant == PER_TILE else variant, N)
    case = f"{geometry} N{N} " + ("rope_causal (keys rotated per tile)" if variant == PER_TILE else variant)
    return Row(
        suite="forward", case=case, work=4 * B * Hq * kept * D, unit="TFLOP/s", geometry=geometry, variant=variant, N=N
    )


def backward_row(geometry: str, N: int, variant: str) -> Row:
    B, Hq, _, D = GEOMETRIES[geometry]
    return Row(
        suite="backward",
        case=f"{geometry} N{N} {variant} fwd+bwd",
        work=TRAINING_FLOPS * 4 * B * Hq * pairs(variant, N) * D,
        unit="TFLOP/s",
        geometry=geometry,
        variant=variant,
        N=N,
    )


def decode_row(model: str, B: int, graphed: bool) -> Row:
    """One new token per sequence against a full cache; the work is K's and V's bf16 bytes, read once."""
    _, Hkv, D, N = DECODE_MODELS[model]
    return Row(
        suite="decode",
        case=f"decode {model} B{B} cache {N} {'CUDA graph' if graphed else 'eager'}",
        work=2 * B * Hkv * N * D * 2,
        unit="GB/s",
        geometry=model,
        variant="CUDA graph" if graphed else "eager",
        N=N,
    )


def sparse_row(N: int, train: bool, sparsity: float, pairs_kept: int) -> Row:
    """BigBird at Llama-3-8B geometry; ``pairs_kept`` per (batch, head), ``sparsity`` the blocks left out."""
    B, Hq, _, D = GEOMETRIES["llama3-8b"]
    return Row(
        suite="sparse",
        case=f"bigbird llama3-8b N{N} ({sparsity:.0%} sparse){' fwd+bwd' if train else ''}",
        work=(TRAINING_FLOPS if train else 1.0) * 4 * B * Hq * pairs_kept * D,
        unit="TFLOP/s",
        geometry="llama3-8b",
        variant="bigbird fwd+bwd" if train else "bigbird",
        N=N,
    )


def packed_row(variant: str, train: bool, lengths: list[int]) -> Row:
    """One packed row of documents of ``lengths`` tokens at Llama-3-8B geometry, ``variant`` causal within
    each document; the work counts the (query, key) pairs inside the documents only."""
    _, Hq, _, D = GEOMETRIES["llama3-8b"]
    total = sum(lengths)
    kept = sum(pairs(variant, n) for n in lengths)
    return Row(
        suite="packed",
        case=f"llama3-8b {total} tokens, {len(lengths)} documents {variant}{' fwd+bwd' if train else ''}",
        work=(TRAINING_FLOPS if train else 1.0) * 4 * Hq * kept * D,
        unit="TFLOP/s",
        geometry="llama3-8b",
        variant=f"{variant} fwd+bwd" if train else variant,
        N=total,
    )


def fp8_row(variant: str, kind: str, N: int) -> Row:
    """Llama-3-8B forward of ``variant`` (causal, dense) at N with float8 q, k, v of ``kind`` (e4m3, e5m2; the
    baselines: bfloat16, or FlashAttention-3's fp8)."""
    row = forward_row("llama3-8b", N, variant)
    name = "fp8" if kind == "e4m3" else f"fp8 {kind}"
    return attrs.evolve(row, suite="fp8", case=f"llama3-8b N{N} {variant} {name}", variant=f"{variant} {name}")


def dropout_row(N: int, p: float) -> Row:
    """Llama-3-8B causal forward + backward at N with attention dropout ``p``."""
    row = backward_row("llama3-8b", N, "causal")
    return attrs.evolve(row, suite="dropout", case=f"llama3-8b N{N} causal dropout {p} fwd+bwd", variant=f"dropout {p}")


@define(kw_only=True)
class Report:
    """A run: ``meta`` (date, gpu, torch, triton, python, command), the rows of the table suites, the
    lines of the list suites (memory, overhead), and a line per case that failed."""

    meta: dict[str, str]
    rows: list[Row] = field(factory=list)
    lines: dict[str, list[str]] = field(factory=dict)
    failures: list[str] = field(factory=list)

    def suites(self) -> list[str]:
        """Suites with results, in the order they ran."""
        return list(dict.fromkeys([*(r.suite for r in self.rows), *self.lines]))

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self), indent=1, ensure_ascii=False) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Report:
        data = json.loads(text)
        return cls(
            meta=data["meta"], rows=[Row(**row) for row in data["rows"]], lines=data["lines"], failures=data["failures"]
        )
