"""``attnfuse bench`` without a GPU: its refusal, and its rows, tables, JSON, page and plot.

The expected cells are worked out by hand from figures the H200 printed (llama3-8b N8192 causal: AttnFuse
1.171 ms = 470 TFLOP/s, flex 1.388 ms = 396, flex / AttnFuse 1.19×).
"""

from __future__ import annotations

import argparse
import io
import sys

import pytest
import torch

import attnfuse as af

from attnfuse.bench import baselines, cases, plot, report, rows, run
from attnfuse.bench.command import command_line, main as bench_main
from attnfuse.cli import main


def timed_rows() -> list[rows.Row]:
    """Rows from the suites' row builders, with times filled in as the suites fill them."""
    causal = rows.forward_row("llama3-8b", 8192, "causal")
    causal.times.update(attnfuse=1.171, fa2_triton=1.190, cudnn=1.030, flash="n/a (no GQA)", flex=1.388)
    causal.err = 3.9e-3
    window = rows.forward_row("llama3-8b", 4096, "sliding_window")
    window.times.update(attnfuse=0.086, flex=0.110)
    window.err = 3.9e-3
    wider = rows.forward_row("llama3-8b", 8192, "sliding_window")
    wider.times.update(attnfuse=0.163, flex=0.210)
    training = rows.backward_row("gpt2", 2048, "sliding_window")
    training.times.update(attnfuse=0.509, flex=0.620)
    decode = rows.decode_row("llama3-70b", 1, graphed=True)
    decode.times.update(attnfuse=0.0388, cudnn=0.038)
    return [causal, window, wider, training, decode]


def sample_report() -> rows.Report:
    meta = {
        "date": "2026-11-29",
        "gpu": "NVIDIA H200",
        "torch": "2.11.0+cu130",
        "triton": "3.6.0",
        "python": "3.12.3",
        "command": "attnfuse bench --suite forward,backward,decode,memory",
    }
    return rows.Report(
        meta=meta,
        rows=timed_rows(),
        lines={"memory": ["peak memory, attnfuse: 0.44 GiB"]},
        failures=["sparse 4096 False: RuntimeError: out of memory"],
    )


def test_bench_without_cuda_says_so_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--suite", "forward"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("attnfuse: error: bench needs a CUDA GPU")
    assert "torch.cuda.is_available() is False" in captured.err
    assert captured.out == ""
    assert bench_main(["--suite", "decode"]) == 2  # python -m attnfuse.bench, for older trees' cli
    assert "bench needs a CUDA GPU" in capsys.readouterr().err


def test_plot_without_matplotlib_is_refused_before_running(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(["bench", "--plot", str(tmp_path / "out.png")]) == 2
    assert (
        "--plot needs matplotlib: pip install matplotlib (from a clone of attnfuse: pip install -e '.[bench]')"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "out.png").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--suite", "forward,speed"], "argument --suite: unknown suite 'speed'"),
        (["--geometry", "llama2"], "argument --geometry: unknown geometry 'llama2'"),
        (["--variants", "causal,flash"], "argument --variants: unknown variant 'flash'"),
        (["--N", "4096,0"], "argument --N: expected comma-separated positive integers, got '4096,0'"),
    ],
)
def test_bad_options_name_the_argument(capsys, argv, message):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_rows_count_the_work_of_the_pairs_kept():
    assert rows.forward_row("llama3-8b", 8192, "causal").work == 4 * 32 * 128 * (8192 * 8193 // 2)
    assert rows.forward_row("gpt2", 4096, "dense").work == 4 * 4 * 12 * 64 * 4096**2
    window = 4 * 12 * 64 * (255 * 256 // 2 + (2048 - 255) * 256)  # queries 0..254 keep i+1 keys, the rest 256
    assert rows.backward_row("gpt2", 2048, "sliding_window").work == 3.5 * 4 * window
    per_tile = rows.forward_row("gpt2", 2048, "rope_causal_per_tile")
    assert per_tile.case == "gpt2 N2048 rope_causal (keys rotated per tile)"
    assert per_tile.work == rows.forward_row("gpt2", 2048, "rope_causal").work
    decode = rows.decode_row("llama3-70b", 8, graphed=False)
    assert (decode.case, decode.work, decode.unit) == (
        "decode llama3-70b B8 cache 32768 eager",
        2 * 8 * 8 * 32768 * 128 * 2,
        "GB/s",
    )
    sparse = rows.sparse_row(4096, True, 0.72, 1000)
    assert (sparse.case, sparse.work) == ("bigbird llama3-8b N4096 (72% sparse) fwd+bwd", 3.5 * 4 * 32 * 1000 * 128)


@pytest.mark.parametrize(
    "total, lengths", [(16384, (256, 4096)), (300, (256, 4096)), (4352, (256, 4096)), (97, (5, 9))]
)
def test_packed_lengths_fill_the_row_with_documents_in_range(total, lengths):
    seeds = range(40)
    for seed in seeds:
        drawn = cases.packed_lengths(total, lengths, seed)
        assert sum(drawn) == total, (seed, drawn)
        assert lengths[0] <= min(drawn) and max(drawn) <= lengths[1], (seed, drawn)
    assert cases.packed_lengths(total, lengths, 0) == cases.packed_lengths(total, lengths, 0)  # seeded
    assert len({tuple(cases.packed_lengths(total, lengths, s)) for s in seeds}) > 1 or total < 2 * lengths[0]
    with pytest.raises(ValueError, match="cannot pack 100 tokens into documents of 256-4096 tokens"):
        cases.packed_lengths(100)


def test_packed_row_counts_the_pairs_inside_the_documents():
    row = rows.packed_row("causal", True, [300, 4000, 12084])
    kept = sum(n * (n + 1) // 2 for n in (300, 4000, 12084))
    assert (row.case, row.work, row.N) == (
        "llama3-8b 16384 tokens, 3 documents causal fwd+bwd",
        3.5 * 4 * 32 * kept * 128,
        16384,
    )
    assert run.cases_of("packed", None)[0] == 2 * len(cases.PACKED_VARIANTS)


def test_fp8_and_dropout_rows_count_the_work_of_their_variant():
    fp8 = rows.fp8_row("causal", "e4m3", 8192)
    assert (fp8.suite, fp8.case, fp8.work) == (
        "fp8",
        "llama3-8b N8192 causal fp8",
        rows.forward_row("llama3-8b", 8192, "causal").work,
    )
    dense = rows.fp8_row("dense", "e5m2", 4096)
    assert (dense.case, dense.work) == (
        "llama3-8b N4096 dense fp8 e5m2",
        rows.forward_row("llama3-8b", 4096, "dense").work,
    )
    dropped = rows.dropout_row(4096, 0.1)
    assert (dropped.suite, dropped.case) == ("dropout", "llama3-8b N4096 causal dropout 0.1 fwd+bwd")
    assert dropped.work == rows.backward_row("llama3-8b", 4096, "causal").work
    assert run.cases_of("fp8", None)[0] == len(cases.FP8_CASES)
    assert run.cases_of("dropout", None)[0] == len(cases.DROPOUT_NS)


def test_fp8_suite_inputs_dequantise_to_what_was_quantised():
    """The fp8 suite's inputs: per-(batch, kv head) descales, float8 values within e4m3's rounding of the
    originals, and an AttnFuse call on them (the CPU's interpreter) matching the bfloat16 baselines' inputs' result."""
    from attnfuse.bench import suites

    x = [torch.randn(2, h, 24, 16) * s for h, s in ((4, 3.0), (2, 0.5), (2, 1.0))]
    (q8, k8, v8), dequantised, scales = suites.quantised(*x)
    assert all(t.dtype == torch.float8_e4m3fn for t in (q8, k8, v8))
    assert all(d.shape == (2, 2) and d.dtype == torch.float32 for d in scales.values())
    for original, back in zip(x, dequantised):
        scale = original.abs().amax()
        assert (back.float() - original).abs().max() <= scale * 2**-4  # e4m3: 3 mantissa bits, bf16 rounding
    out = cases.PROGRAMS["causal"](q8, k8, v8, **scales, out_dtype=torch.float32)
    want = cases.PROGRAMS["causal"].reference(*(t.float() for t in dequantised))
    assert (out.double() - want).abs().max() < 2e-2


def test_dropout_suite_checks_attnfuse_against_its_replayed_mask():
    """The dropout suite's ``err``: a call's first (batch, head) against causal attention in float32 with the
    call's mask replayed from its state; another state's mask gives a large difference."""
    from attnfuse.bench import suites

    q, k, v = (torch.randn(1, h, 40, 16) for h in (2, 1, 1))
    state = torch.get_rng_state()
    out = cases.PROGRAMS["causal"](q, k, v, dropout_p=0.3)
    torch.set_rng_state(state)
    drawn = af.dropout_state(q.device)
    assert suites.replayed_error(q, k, v, out, drawn, 0.3) < 1e-5
    assert suites.replayed_error(q, k, v, out, drawn + 1, 0.3) > 1e-2


def test_flex_document_mask_keeps_each_document_causal_and_alone():
    """The packed suite's flex baseline: document-causal flex_attention (its CPU path) equals SDPA run on each
    document alone, with GQA."""
    from torch.nn.attention.flex_attention import flex_attention

    lengths = [5, 9, 1, 3]
    cu = torch.tensor([0, 5, 14, 15, 18], dtype=torch.int32)
    q, k, v = (torch.randn(1, h, 18, 16, dtype=torch.float64) for h in (4, 2, 2))
    with pytest.warns(UserWarning):  # flex_attention without torch.compile: its reference path
        got = flex_attention(q, k, v, block_mask=baselines.flex_document_mask(cu), enable_gqa=True)
    alone = [
        torch.nn.functional.scaled_dot_product_attention(
            q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, enable_gqa=True
        )
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())
    ]
    assert sum(lengths) == 18
    torch.testing.assert_close(got, torch.cat(alone, dim=2))


def test_cells_and_ratios_match_the_printed_figures():
    causal, window, _, training, decode = timed_rows()
    table = [causal, window]
    assert report.format_row(causal, table) == (
        "| llama3-8b N8192 causal | 1.171 (470) | 1.190 (462) | 1.030 (534) | "
        "n/a (no GQA) | 1.388 (396) | 1.19× | 0.88× | 3.9e-03 |"
    )
    assert report.format_row(window, table) == (
        "| llama3-8b N4096 sliding_window | 0.086 (194) | — | — | — | 0.110 (151) | 1.28× | — | 3.9e-03 |"
    )  # 16645095424 FLOPs
    assert report.format_row(training, [training]) == (
        "| gpt2 N2048 sliding_window fwd+bwd | 0.509 (42) | 0.620 (34) | 1.22× | — |"
    )
    assert report.cell(decode, "attnfuse") == "0.039 (3459 GB/s)"  # 134217728 bytes / 0.0388 ms


def test_table_keeps_only_the_columns_some_row_has():
    _, window, wider, _, decode = timed_rows()
    assert report.table([window, wider]).splitlines()[:2] == [
        "| case | AttnFuse ms (TFLOP/s) | flex (compiled) | flex / AttnFuse | max abs diff |",
        "|---|---|---|---|---|",
    ]
    assert report.header([decode]).startswith("| case | AttnFuse ms (GB/s) | cuDNN SDPA | cuDNN / AttnFuse |")
    every = report.header(None).splitlines()[0]  # lines printed while a suite runs: every column
    assert every.count("|") == 12 and "FA2 Triton (hand-written)" in every and "FlashAttention-3 fp8" in every


def test_report_json_round_trip():
    original = sample_report()
    text = original.to_json()
    again = rows.Report.from_json(text)
    assert again == original
    assert again.rows[0].times["attnfuse"] == 1.171 and again.rows[0].times["flash"] == "n/a (no GQA)"
    assert again.rows[3].err is None
    assert again.suites() == ["forward", "backward", "decode", "memory"]


def test_markdown_page_has_the_run_one_table_per_suite_and_the_plot(tmp_path):
    result = sample_report()
    page = report.markdown_page(result, plot=str(tmp_path / "images" / "h200.png"), page=str(tmp_path / "bench.md"))
    lines = page.splitlines()
    assert lines[0] == "# Benchmarks: NVIDIA H200, 2026-11-29"
    assert "NVIDIA H200 · torch 2.11.0+cu130 · triton 3.6.0 · Python 3.12.3" in lines[2]
    assert "```bash\nattnfuse bench --suite forward,backward,decode,memory\n```" in page
    assert "![AttnFuse and the baselines, TFLOP/s against N](images/h200.png)" in lines
    sections = [line for line in lines if line.startswith("## ")]
    assert sections == [
        "## Forward",
        "## Forward + backward",
        "## Decoding (one query per sequence, full cache)",
        "## Memory",
        "## Failed cases",
    ]
    forward = lines[lines.index("## Forward") + 2 : lines.index("## Forward + backward") - 1]
    assert forward == report.table(result.rows[:3]).splitlines()
    assert "- peak memory, attnfuse: 0.44 GiB" in lines
    assert lines[-1] == "- sparse 4096 False: RuntimeError: out of memory"


def test_rewriting_the_page_keeps_the_sections_of_other_commands(tmp_path):
    path = tmp_path / "benchmarks.md"
    other = (
        "<!-- BEGIN hf_layer -->\n## A decoder layer\n\n| backend | ms |\n|---|---|\n| sdpa | 1.773 |\n"
        "<!-- END hf_layer -->\n"
    )
    path.write_text("# Benchmarks: an older run\n\n## Forward\n\n| old table |\n\n" + other)
    result = sample_report()
    page = report.markdown_page(result, page=str(path), kept=report.kept_sections(str(path)))
    assert page.startswith("# Benchmarks: NVIDIA H200, 2026-11-29") and "| old table |" not in page
    assert page.endswith("\n" + other + "\n")
    assert report.kept_sections(str(tmp_path / "absent.md")) == ""


def test_markdown_section_writes_each_suite_as_a_marked_section_and_nothing_else(tmp_path):
    """``--markdown-section``: each suite of the run replaces its own section (suite_NAME) of the page, the
    page's other lines and sections stay, and a suite's failed cases are listed under its table."""
    path = tmp_path / "benchmarks.md"
    path.write_text(
        "# Benchmarks: a run\n\n| its table |\n\n<!-- BEGIN suite_forward -->\nold\n<!-- END suite_forward -->\n"
    )
    result = sample_report()
    result.failures.append("forward gpt2 2048 causal_alibi: RuntimeError: out of shared memory")
    args = argparse.Namespace(json=None, plot=None, markdown=None, markdown_section=str(path))
    run.save(args, result)
    text = path.read_text()
    assert text.startswith("# Benchmarks: a run\n\n| its table |\n\n<!-- BEGIN suite_forward -->\n## Forward\n")
    assert "\nold\n" not in text
    names = [m["name"] for m in report.SECTION.finditer(text)]
    assert names == ["suite_forward", "suite_backward", "suite_decode", "suite_memory"]
    forward = next(m["body"] for m in report.SECTION.finditer(text) if m["name"] == "suite_forward")
    assert report.table(result.rows[:3]) in forward and "```bash\nattnfuse bench --suite" in forward
    assert forward.endswith("Failed cases:\n\n- forward gpt2 2048 causal_alibi: RuntimeError: out of shared memory\n")
    backward = next(m["body"] for m in report.SECTION.finditer(text) if m["name"] == "suite_backward")
    assert "Failed cases" not in backward and "sparse 4096" not in text
    memory = next(m["body"] for m in report.SECTION.finditer(text) if m["name"] == "suite_memory")
    assert "- peak memory, attnfuse: 0.44 GiB" in memory


def test_run_table_prints_each_row_and_records_failures(monkeypatch):
    def row_of(geometry, N, variant):  # as a suite's case does: the row builder, then its times
        if variant == "causal_alibi":
            raise RuntimeError("out of shared memory")
        row = rows.forward_row(geometry, N, variant)
        row.times.update(attnfuse=1.0, flex=2.0)
        return row

    cases = [(row_of, ("gpt2", 2048, "dense")), (row_of, ("gpt2", 2048, "causal_alibi"))]
    monkeypatch.setattr(run, "cases_of", lambda suite, args: (len(cases), cases))
    monkeypatch.setitem(sys.modules, "tqdm", None)  # plain printing
    result, out = rows.Report(meta={}), io.StringIO()
    run.run_table("forward", None, result, out)
    printed = out.getvalue().splitlines()
    assert printed[0] == "## Forward" and printed[2].startswith("| case | AttnFuse ms (TFLOP/s) |")
    # 51.5e9 FLOPs; every contender's column while the suite runs
    assert printed[4] == "| gpt2 N2048 dense | 1.000 (52) | — | — | — | 2.000 (26) | — | — | 2.00× | — | — |"
    assert printed[5] == "| forward gpt2 2048 causal_alibi: RuntimeError: out of shared memory |"
    assert [r.case for r in result.rows] == ["gpt2 N2048 dense"]
    assert result.failures == ["forward gpt2 2048 causal_alibi: RuntimeError: out of shared memory"]


def test_default_suites_leave_out_the_gated_features():
    """packed, fp8 and dropout run on a GPU only with their gates open: asked by name, never by default."""
    from attnfuse.cli import build_parser

    args = build_parser().parse_args(["bench"])
    assert args.suite == ["forward", "backward", "decode", "sparse", "memory", "overhead"]
    every = build_parser().parse_args(["bench", "--suite", "all"]).suite
    assert {"packed", "fp8", "dropout"} <= set(every) and set(args.suite) < set(every)


def test_command_line_spells_out_the_run():
    from attnfuse.cli import build_parser

    args = build_parser().parse_args(["bench", "--suite", "forward,memory", "--N", "4096", "--json", "o.json"])
    assert command_line(args) == (
        "attnfuse bench --suite forward,memory --geometry gpt2,llama3-8b --N 4096 "
        "--variants dense,causal,sliding_window,causal_alibi,rope_causal,"
        "rope_causal_per_tile --json o.json"
    )


def test_plot_draws_a_panel_per_suite_geometry_and_variant(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (the attnfuse[bench] extra) is not installed")
    result = sample_report()
    assert list(plot.panels(result.rows)) == [
        ("forward", "llama3-8b", "causal"),
        ("forward", "llama3-8b", "sliding_window"),
        ("backward", "gpt2", "sliding_window"),
    ]
    assert [r.N for r in plot.panels(result.rows)[("forward", "llama3-8b", "sliding_window")]] == [4096, 8192]
    path = tmp_path / "bench.png"
    assert plot.plot(result.rows, str(path), report.title(result.meta)) == 3
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot.plot(result.rows[-1:], str(tmp_path / "none.png"), "decode only") == 0
    assert not (tmp_path / "none.png").exists()


def test_overhead_breakdown_times_each_piece_of_a_warm_call():
    """The host breakdown runs anywhere (here, launches through the interpreter): every case, every piece."""
    from attnfuse.bench.host_time import PIECES, breakdown_lines

    lines = breakdown_lines("cpu", calls=1, N=16, D=16)
    assert [line.split(":")[0] for line in lines] == [
        "host time per warm call, causal",
        "host time per warm call, rope+causal, cos/sin tables",
        "host time per warm call, BlockMask (causal blocks)",
        "host time per warm call, decode, paged, kv_lens and block_table, validated",
    ]
    for line in lines:
        checked = "decode" in line
        assert all((piece in line) == (checked or piece != "kv_lens/block_table check") for piece in PIECES[1:])
        figures = [
            float(word)
            for word in line.replace("(", " ").replace(",", " ").replace(")", " ").split()
            if word.replace(".", "", 1).isdigit()
        ]
        assert figures and all(f > 0 for f in figures)
