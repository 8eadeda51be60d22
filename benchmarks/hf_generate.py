"""HF ``generate()`` end to end: tokens per second of greedy generation on a Llama-architecture model with
random weights (1B-size by default: hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192, vocab 128256),
attn_implementation "sdpa" against "attnfuse", eagerly and compiled with a static cache.

    python benchmarks/hf_generate.py [--batch 1,8] [--prompt 512] [--new-tokens 256] [--modes eager,compiled]
    python benchmarks/hf_generate.py --markdown-section docs/benchmarks.md   # rewrite its section there
    python benchmarks/hf_generate.py --device cpu --dtype float32 --layers 2 --hidden 64 --heads 4 --kv-heads 2 \\
        --intermediate 128 --vocab 100 --prompt 8 --new-tokens 3 --batch 1 --warmup 1 --runs 1 \\
        --compile-backend aot_eager   # a CPU smoke run of the script (interpreter; no timings worth reading)

Modes: "eager" is ``generate()`` with its default DynamicCache. "compiled" passes
``cache_implementation="static"`` and a ``CompileConfig``: with a static cache, transformers 5's
``generate()`` compiles the model's call itself (``GenerationMixin._valid_auto_compile_criteria`` and
``PreTrainedModel.get_compiled_call``) and runs every decode step through it, the prefill eagerly; by default
with Inductor in mode "reduce-overhead" (CUDA graphs), HF's CompileConfig defaults. (The older recipe of
also assigning ``model.forward = torch.compile(model.forward)`` would compile the forward a second time,
inside the compiled call.) Each batch size of the compiled mode starts from ``torch._dynamo.reset()``, so
its graphs are compiled for its own static shapes.

Every generate() makes exactly --new-tokens tokens per sequence (greedy, ``min_new_tokens`` =
``max_new_tokens``, so the end-of-sequence token never stops it) from the same random prompt (no padding).
Each implementation runs on its own copy of the model (same weights), after --warmup untimed calls (the
first compiles); then in each of --runs rounds each implementation is timed once (``time.perf_counter``
with ``torch.cuda.synchronize()`` before and after), in an order rotated every round. A figure is the
median of its rounds: tokens/s = new tokens x batch / seconds (the prefill included), ms per token =
seconds / new tokens.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import textwrap
import time

import torch
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

import attnfuse.hf  # noqa: F401 - registers attn_implementation="attnfuse"
from attnfuse.bench import report

SECTION = "hf_generate"  # its marked section of docs/benchmarks.md (--markdown-section)
IMPLEMENTATIONS = ("sdpa", "attnfuse")
MODES = ("eager", "compiled")
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="1,8", help="batch sizes, comma-separated (1,8)")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens per sequence (512)")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens generated per sequence (256)")
    parser.add_argument("--modes", default="eager,compiled", help="eager, compiled or both (eager,compiled)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--rope-theta", type=float, default=500000.0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--warmup", type=int, default=2, help="untimed generate() calls per implementation (2)")
    parser.add_argument("--runs", type=int, default=5, help="timed generate() calls per figure, in turns (5)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of compiled mode")
    parser.add_argument(
        "--compile-mode",
        default="reduce-overhead",
        help="torch.compile mode of compiled mode (reduce-overhead; 'default' for no CUDA graphs)",
    )
    parser.add_argument("--fullgraph", action="store_true", help="compile with fullgraph=True: a graph break raises")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--markdown-section",
        metavar="PATH",
        help=f"also write the table as the section '{SECTION}' of the page at PATH "
        f"(docs/benchmarks.md), replacing only that section",
    )
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batch.split(",")]
    args.mode_list = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(args.mode_list) - set(MODES))
    if unknown:
        parser.error(f"--modes: unknown mode(s) {', '.join(unknown)}; allowed: {', '.join(MODES)}")
    return args


def build_models(args: argparse.Namespace) -> dict[str, LlamaForCausalLM]:
    """One model per implementation, the same random weights (seeded), in eval mode on the device."""
    config = LlamaConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate,
        vocab_size=args.vocab,
        rope_theta=args.rope_theta,
        tie_word_embeddings=True,
        max_position_embeddings=max(8192, args.prompt + args.new_tokens),
    )
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = LlamaForCausalLM(config)
    model = model.to(DTYPES[args.dtype]).eval()
    models = {}
    for name in IMPLEMENTATIONS:
        models[name] = copy.deepcopy(model)
        models[name].set_attn_implementation(name)
    return models


def compile_config(args: argparse.Namespace) -> CompileConfig:
    """The compiled mode's CompileConfig; off CUDA, generate() compiles only when told to."""
    config = CompileConfig(fullgraph=args.fullgraph, backend=args.compile_backend, mode=args.compile_mode)
    if not args.device.startswith("cuda"):
        config._compile_all_devices = True  # HF's flag for compiling off CUDA (for tests)
    return config


def generate_options(args: argparse.Namespace, mode: str) -> dict:
    """generate()'s keywords: greedy, exactly --new-tokens tokens, and a static cache compiled in "compiled"."""
    options = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    if mode == "compiled":
        options.update(cache_implementation="static", compile_config=compile_config(args))
    return options


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(model: LlamaForCausalLM, ids: torch.Tensor, options: dict, device: str) -> tuple[float, torch.Tensor]:
    """Seconds of one generate() call, and its new tokens (B, new)."""
    mask = torch.ones_like(ids)
    synchronize(device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, **options)
    synchronize(device)
    return time.perf_counter() - start, out[:, ids.shape[1] :]


def graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def leading_agreement(tokens: torch.Tensor, baseline: torch.Tensor) -> int:
    """How many new tokens, from the first, every sequence of ``tokens`` shares with ``baseline``'s."""
    differs = (tokens != baseline).any(dim=0).nonzero()
    return int(differs[0]) if len(differs) else tokens.shape[1]


def measure(models: dict[str, LlamaForCausalLM], args: argparse.Namespace, mode: str, batch: int) -> list[dict]:
    """One row per implementation for ``mode`` and ``batch``: the median seconds of its rounds, the first
    call's seconds (a compile in "compiled"), graph breaks while compiling, tokens shared with sdpa's."""
    if mode == "compiled":
        torch._dynamo.reset()
    ids = torch.randint(0, args.vocab, (batch, args.prompt), generator=torch.Generator().manual_seed(args.seed + batch))
    ids = ids.to(args.device)
    options = generate_options(args, mode)
    first, breaks, tokens = {}, {}, {}
    for name, model in models.items():
        before = graph_breaks()
        for _ in range(max(args.warmup, 1)):
            seconds, _ = timed(model, ids, options, args.device)
            first.setdefault(name, seconds)
        breaks[name] = graph_breaks() - before
    times: dict[str, list[float]] = {name: [] for name in models}
    names = list(models)
    for r in range(args.runs):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            seconds, tokens[name] = timed(models[name], ids, options, args.device)
            times[name].append(seconds)
    rows = []
    for name in names:
        seconds = statistics.median(times[name])
        rows.append(
            dict(
                mode=mode,
                batch=batch,
                implementation=name,
                seconds=seconds,
                tokens_per_s=args.new_tokens * batch / seconds,
                ms_per_token=seconds / args.new_tokens * 1e3,
                spread=(max(times[name]) - min(times[name])) / seconds,
                first_s=first[name],
                graph_breaks=breaks[name] if mode == "compiled" else None,
                agree=leading_agreement(tokens[name], tokens["sdpa"]),
            )
        )
    for row in rows:
        row["ratio"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows


COLUMNS = (
    "mode",
    "batch",
    "implementation",
    "tokens/s",
    "ms per token",
    "attnfuse / sdpa",
    "spread",
    "first call s",
    "graph breaks",
    "new tokens equal to sdpa's",
)


def cells(row: dict, new_tokens: int) -> list[str]:
    return [
        row["mode"],
        str(row["batch"]),
        row["implementation"],
        f"{row['tokens_per_s']:.1f}",
        f"{row['ms_per_token']:.2f}",
        f"{row['ratio']:.3f}",
        f"{row['spread']:.1%}",
        f"{row['first_s']:.1f}",
        "—" if row["graph_breaks"] is None else str(row["graph_breaks"]),
        f"{row['agree']}/{new_tokens}",
    ]


def explanation(args: argparse.Namespace) -> str:
    """What the section's table measures."""
    return (
        f"Greedy HF generate() on a Llama-architecture model with random weights (hidden {args.hidden}, "
        f"{args.layers} layers, {args.heads} heads, {args.kv_heads} KV heads, MLP {args.intermediate}, vocab "
        f"{args.vocab}, tied embeddings), {args.prompt}-token random prompts, exactly {args.new_tokens} new "
        f"tokens per sequence, per attn_implementation, in one process on the same prompts; each "
        f"implementation on its own copy of the model. eager: the default DynamicCache, nothing compiled. "
        f'compiled: cache_implementation="static" with CompileConfig(backend={args.compile_backend!r}, '
        f"mode={args.compile_mode!r}, fullgraph={args.fullgraph}): generate() compiles the model's call for "
        f"the decode steps (the prefill runs eagerly). After {args.warmup} untimed call(s), each implementation "
        f"is timed once in each of {args.runs} rounds (perf_counter, synchronised), in turns; a figure is the "
        f'median of its rounds, "spread" their range over it. tokens/s = new tokens x batch / seconds of the '
        f'whole call (prefill included); ms per token = seconds / new tokens; "attnfuse / sdpa" is the '
        f'ratio of tokens/s (above 1: attnfuse is faster). "first call s": the first call\'s seconds (in '
        f'compiled mode, its compile); "graph breaks": Dynamo\'s while compiling; the last column counts the '
        f"new tokens, from the first, that every sequence shares with sdpa's (random weights give nearly "
        f"tied logits, so rounding alone can change a greedy choice)."
    )


def section(rows: list[dict], args: argparse.Namespace, meta: dict[str, str]) -> str:
    """The page's section: heading, versions, the command, what is measured, and the table."""
    lines = [
        f"## HF generate() end to end: a Llama-architecture model, {args.layers} layers, hidden {args.hidden}",
        "",
        f"{report.versions(meta)} · {meta['dtype']}, median seconds of {args.runs} generate() calls.",
        "",
        "Printed by:",
        "",
        "```bash",
        meta["command"],
        "```",
        "",
        textwrap.fill(explanation(args), width=105),
        "",
        f"| {' | '.join(COLUMNS)} |",
        f"|{'---|' * len(COLUMNS)}",
    ]
    lines += [f"| {' | '.join(cells(row, args.new_tokens))} |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    torch._dynamo.config.recompile_limit = 64  # a model per implementation: one compile each
    models = build_models(args)
    print(
        f"HF generate(): {args.layers} layers, hidden {args.hidden}, {args.dtype} on {args.device}, prompt "
        f"{args.prompt}, {args.new_tokens} new tokens; median of {args.runs} rounds after {args.warmup} warm-up"
    )
    widths = (10, 6, 16, 11, 14, 17, 8, 14, 14, 28)
    print("".join(f"{c:>{w}}" for c, w in zip(COLUMNS, widths)), flush=True)
    rows = []
    for mode in args.mode_list:
        for batch in args.batches:
            for row in measure(models, args, mode, batch):
                rows.append(row)
                print("".join(f"{c:>{w}}" for c, w in zip(cells(row, args.new_tokens), widths)), flush=True)
    if args.markdown_section:
        meta = report.script_meta(sys.argv, args.dtype)
        report.write_section(args.markdown_section, SECTION, section(rows, args, meta))


if __name__ == "__main__":
    main()
