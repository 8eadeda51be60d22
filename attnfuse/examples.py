"""Named example programs, as ``attnfuse show <name>`` and ``attnfuse demo`` use them.

from attnfuse.examples import EXAMPLES, llama
out = llama(q, k, v)
"""

from __future__ import annotations

import attnfuse as af
from attnfuse.program import AttentionProgram

__all__ = ["EXAMPLES", "alibi", "gpt2", "llama", "mistral", "relu"]


@af.attention
def llama(q, k, v):
    """Llama: rotary embedding, causal mask, softmax."""
    s = af.rope(q, k)
    s = af.causal(s)
    return af.softmax(s) @ v


@af.attention
def gpt2(q, k, v):
    """GPT-2: scaled dot product, causal mask, softmax."""
    s = af.scaled_dot_product(q, k)
    s = af.causal(s)
    return af.softmax(s) @ v


@af.attention
def mistral(q, k, v):
    """Mistral 7B: rotary embedding, a 4096-key sliding window (left=4095), softmax."""
    s = af.rope(q, k)
    s = af.sliding_window(s, left=4095)
    return af.softmax(s) @ v


@af.attention
def alibi(q, k, v):
    """ALiBi: scaled dot product, causal mask, linear position bias, softmax."""
    s = af.scaled_dot_product(q, k)
    s = af.causal(s)
    s = af.alibi(s)
    return af.softmax(s) @ v


@af.attention
def relu(q, k, v):
    """ReLU attention (Wortsman et al., 2023): scaled dot product, causal mask, relu(s)/Nk."""
    s = af.scaled_dot_product(q, k)
    s = af.causal(s)
    return af.relu_attention(s) @ v


EXAMPLES: dict[str, AttentionProgram] = {
    "llama": llama,
    "gpt2": gpt2,
    "mistral": mistral,
    "alibi": alibi,
    "relu": relu,
}
