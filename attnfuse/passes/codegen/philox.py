"""Triton's ``tl.randint4x`` written out as kernel text that both Triton and Gluon kernels run: the generated
kernels and the Hopper templates draw attention dropout's numbers from this one text, so their masks are
bit-identical.

Gluon has no ``randint4x`` (it cannot call a ``@triton.jit`` function), but it runs the integer builtins
``tl.randint4x`` is made of. ``words`` is ``tl.randint4x(seed, counter)`` for an int64 seed and an int64 counter
tile, step for step (``triton/language/random.py``): Philox-4x32 with 10 rounds of counter (low word, high word,
0, 0) and key (seed's low word, high word), its four uint32 words. Products and sums wrap
(``sanitize_overflow=False``, as there: the interpreter checks overflow otherwise). Only the counter makes the
interim tiles (``x * 0``), so nothing needs a layout.
"""

from __future__ import annotations

ROUNDS = 10
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85  # the key's increments per round
ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57  # the round multipliers

_PHILOX = f"""\
{{t}}_c0 = {{counter}}.to(tl.uint32)
{{t}}_c1 = ({{counter}} >> 32).to(tl.uint32)
{{t}}_c2 = {{t}}_c0 * 0
{{t}}_c3 = {{t}}_c2
{{t}}_key = {{seed}}.to(tl.uint64)
{{t}}_k0 = ({{t}}_key & 0xFFFFFFFF).to(tl.uint32)
{{t}}_k1 = (({{t}}_key >> 32) & 0xFFFFFFFF).to(tl.uint32)
for {{t}}_round in tl.static_range({ROUNDS}):
    {{t}}_a, {{t}}_b = {{t}}_c0, {{t}}_c2
    {{t}}_c0 = tl.umulhi({{t}}_b, {ROUND_B:#x}) ^ {{t}}_c1 ^ {{t}}_k0
    {{t}}_c2 = tl.umulhi({{t}}_a, {ROUND_A:#x}) ^ {{t}}_c3 ^ {{t}}_k1
    {{t}}_c1 = tl.mul({{t}}_b, {ROUND_B:#x}, sanitize_overflow=False)
    {{t}}_c3 = tl.mul({{t}}_a, {ROUND_A:#x}, sanitize_overflow=False)
    {{t}}_k0 = tl.add({{t}}_k0, {KEY_A:#x}, sanitize_overflow=False)
    {{t}}_k1 = tl.add({{t}}_k1, {KEY_B:#x}, sanitize_overflow=False)
"""


def words(seed: str, counter: str, outs: tuple[str, str, str, str], temp: str = "philox") -> str:
    """Statements setting the four names ``outs`` to ``tl.randint4x(seed, counter)``, bit for bit: uint32, each
    of ``counter``'s shape. ``seed``: an int64 scalar; ``counter``: an int64 tile (non-negative); ``temp``: the
    prefix of the names the statements assign besides ``outs``."""
    named = "".join(f"{out} = {temp}_c{i}\n" for i, out in enumerate(outs))
    return _PHILOX.format(t=temp, seed=seed, counter=counter) + named
