"""The templates' tiles and register split, by head dim: the constants of this kernel family, in one place.

A forward program is 2 x 64 query rows (``pipeline.ROWS`` per consumer warpgroup); it streams ``block_n`` keys
a step through ``stages`` shared-memory stages. Each choice keeps the consumers' registers under their budget
(no spills: ``tests/test_template_resources.py``) and the shared memory in an H100/H200 block
(Q's 2 x 64 rows, then ``stages`` x (K + V) tiles of ``block_n`` rows). A dK/dV program is 2 x 64 keys; it
streams query blocks of 64 rows through ``stages`` stages of Q and dO tiles. A dQ program is 2 x 64 query rows,
as the forward's; it streams ``block_n`` keys a step (K and V tiles) through ``stages`` stages.
"""

from __future__ import annotations

from attrs import frozen

SHARED_MEMORY_LIMIT = 232448  # bytes of shared memory a block may use on an H100/H200 (227 KiB)


@frozen
class ForwardTiles:
    block_n: int  # keys per step
    stages: int  # K and V tiles in flight


FORWARD_TILES = {
    64: ForwardTiles(block_n=128, stages=3),
    128: ForwardTiles(block_n=128, stages=3),
    256: ForwardTiles(block_n=64, stages=2),
}
FP8_TILES = {  # float8 instances (``forward_fp8``): their K and V tiles take half the bytes, so 4 stages fit at head
    # dim 128; on an H100, 4 stages against 3 ran dense e4m3 at 16384 keys at 822 to 832 TFLOP/s against 733 to 778,
    # causal alike (head dim 64 not measured yet)
    64: FORWARD_TILES[64],
    128: ForwardTiles(block_n=128, stages=4),
}
NARROW_TILES = {  # programs whose score modifications load a tensor per score (an additive bias: its addresses
    # take registers a score tile of 128 keys does not leave), or whose masks start past key 0 (a sliding window:
    # masked blocks at both ends of few keys, whose two bounds' tests spilled in the loop at 128 keys); at head dim
    # 256 the bias's addresses spilled in the loop at 64 keys
    64: ForwardTiles(block_n=64, stages=4),
    128: ForwardTiles(block_n=64, stages=4),
    256: ForwardTiles(block_n=32, stages=3),
}


@frozen
class DkdvTiles:
    stages: int  # Q and dO tiles in flight (a dK/dV program: 2 x 64 keys, query blocks of 64 rows a step)


DKDV_TILES = {  # shared memory: K and V (2 x 64 rows each), stages x (Q + dO) of 64 rows, 4 P/dS tiles of 64 x 64
    64: DkdvTiles(stages=3),
    128: DkdvTiles(stages=2),
}


@frozen
class DqTiles:
    block_n: int  # keys per step (a dQ program: 2 x 64 query rows, as the forward's)
    stages: int  # K and V tiles in flight


DQ_TILES = {  # shared memory: Q and dO (2 x 64 rows each), stages x (K + V) of block_n rows; the step's S, dP
    # (64 x block_n each) and dQ (64 x D) accumulators take a consumer's registers: at head dim 128, 128 keys a
    # step made ptxas spill in the loop (ALiBi, softcap)
    64: DqTiles(block_n=128, stages=3),
    128: DqTiles(block_n=64, stages=3),
}
DQ_NARROW_TILES = {  # programs whose listing mask reads a tensor per score in its partial blocks (a token block
    # mask's), or with score modifications and dropout: at head dim 64, the mask's addresses, or the modifications'
    # kept inputs beside dropout's draws, on a step of 128 keys made ptxas spill in the loop
    64: DqTiles(block_n=64, stages=3),
    128: DqTiles(block_n=64, stages=3),
}
