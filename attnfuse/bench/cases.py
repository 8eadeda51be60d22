"""What the benchmark runs: model geometries, the AttnFuse programs, and the inputs they need.

Geometries are (B, Hq, Hkv, D); decoding models (Hq, Hkv, D, cache length). Nothing here needs a GPU
except where a ``device`` says so.
"""

from __future__ import annotations

import torch

import attnfuse as af

GEOMETRIES = {"gpt2": (4, 12, 12, 64), "llama3-8b": (1, 32, 8, 128)}
DECODE_MODELS = {"llama3-8b": (32, 8, 128, 4096), "llama3-70b": (64, 8, 128, 32768), "mistral-7b": (32, 8, 128, 16384)}
WINDOW = 256  # keys kept per query by sliding_window, its own included
SPARSE_BLOCK = 128  # BigBird's block size, for AttnFuse's BlockMask and flex's alike
PACKED_TOKENS = 16384  # one packed row of documents (the packed suite)
PACKED_LENGTHS = (256, 4096)  # the least and most tokens of a packed document


@af.attention
def dense(q, k, v):
    return af.softmax(af.scaled_dot_product(q, k)) @ v


@af.attention
def causal(q, k, v):
    return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def sliding_window(q, k, v):
    return af.softmax(af.sliding_window(af.scaled_dot_product(q, k), WINDOW - 1)) @ v


@af.attention
def causal_alibi(q, k, v):
    return af.softmax(af.alibi(af.causal(af.scaled_dot_product(q, k)))) @ v


@af.attention
def rope_causal(q, k, v):
    return af.softmax(af.causal(af.rope(q, k))) @ v


@af.attention
def packed_rope_causal(q, k, v, cos, sin):
    """rope_causal with given tables: a packed call indexes them by each document's own positions."""
    return af.softmax(af.causal(af.rope(q, k, cos=cos, sin=sin))) @ v


@af.attention
def decode_program(q, k, v):
    return af.softmax(af.scaled_dot_product(q, k)) @ v


@af.attention
def bigbird_program(q, k, v, block_mask):
    return af.softmax(af.block_sparse(af.scaled_dot_product(q, k), block_mask)) @ v


PROGRAMS = {p.__name__: p for p in (dense, causal, sliding_window, causal_alibi, rope_causal)}
# rope_causal with every key tile rotated in the key loop (no hoisted key pass): the fused kernel alone
PER_TILE = "rope_causal_per_tile"
FORWARD_VARIANTS = (*PROGRAMS, PER_TILE)
BACKWARD_VARIANTS = ("causal", "rope_causal", "sliding_window")
PACKED_VARIANTS = ("causal", "rope_causal")  # causal within each document
# the fp8 suite's rows (Llama-3-8B geometry, forward): (variant, float8 kind, N)
FP8_CASES = (
    *(("causal", "e4m3", N) for N in (4096, 8192, 16384)),
    ("causal", "e5m2", 8192),
    *(("dense", "e4m3", N) for N in (8192, 16384)),
)
FP8_KINDS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}  # the float8 types a row names
DROPOUT_NS = (2048, 4096, 8192)  # the dropout suite's (Llama-3-8B geometry, causal forward + backward)
DROPOUT_P = 0.1


def pairs(variant: str, N: int) -> int:
    """(query, key) pairs ``variant`` keeps at N queries and N keys."""
    if variant == "dense":
        return N * N
    if variant == "sliding_window":
        return sum(min(i + 1, WINDOW) for i in range(N))
    return N * (N + 1) // 2


def packed_lengths(total: int = PACKED_TOKENS, lengths: tuple[int, int] = PACKED_LENGTHS, seed: int = 0) -> list[int]:
    """Document lengths, each in ``lengths`` (least, most), summing to ``total``: drawn uniformly with ``seed``
    while more than ``most`` tokens are left; those left become the last document, or where they are fewer
    than ``least``, join the one before it (split again into ``least`` and the rest if that gets too long)."""
    least, most = lengths
    if total < least or most < 2 * least - 1:
        raise ValueError(f"cannot pack {total} tokens into documents of {least}-{most} tokens")
    g = torch.Generator().manual_seed(seed)
    found: list[int] = []
    while total - sum(found) > most:
        found.append(int(torch.randint(least, most + 1, (1,), generator=g)))
    rest = total - sum(found)
    if rest >= least or not found:
        return [*found, rest]
    last = found.pop() + rest  # from least + 1 to most + least - 1 tokens
    return [*found, last] if last <= most else [*found, last - least, least]


def rope_tables(N: int, D: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (N, D) float32: NeoX half split, theta 10000, as plugins/rope.py computes them."""
    inv_freq = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64, device=device) / D)
    emb = torch.arange(N, device=device, dtype=torch.float64)[:, None] * inv_freq
    emb = torch.cat((emb, emb), dim=-1)
    return emb.cos().float(), emb.sin().float()


def alibi_slopes(H: int, device) -> torch.Tensor:
    """ALiBi's default slopes (H,) float32, as plugins/alibi.py uses them."""
    from attnfuse_plugins.alibi import default_slopes

    return torch.tensor(default_slopes(H), device=device, dtype=torch.float32)


def bigbird_blocks(
    B: int,
    H: int,
    N: int,
    block: int = SPARSE_BLOCK,
    seed: int = 0,
    randoms: int = 3,
    global_blocks: int = 2,
    device="cuda",
) -> torch.Tensor:
    """BigBird's (B, H, N/block, N/block) bool block grid: a band of ±1 blocks, ``global_blocks`` global
    blocks and ``randoms`` random blocks per query block."""
    n = N // block
    g = torch.Generator(device=device).manual_seed(seed)
    active = torch.zeros(B, H, n, n, dtype=torch.bool, device=device)
    active.scatter_(-1, torch.randint(0, n, (B, H, n, randoms), generator=g, device=device), True)
    qb, kb = torch.arange(n, device=device)[:, None], torch.arange(n, device=device)[None, :]
    return active | ((qb - kb).abs() <= 1) | (qb < global_blocks) | (kb < global_blocks)
