"""The ``attnfuse`` command, run in-process through ``main`` (and once as ``python -m attnfuse.cli``)."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import attnfuse as af
from attnfuse import ir
from attnfuse.cli import main
from attnfuse.combinator import Role
from attnfuse.examples import EXAMPLES, llama
from attnfuse.program import AttentionProgram
from attnfuse.runtime.source_cache import CACHE_ENV

BUILTINS = {
    "scaled_dot_product": "score source",
    "rope": "score source",
    "alibi": "score modification",
    "additive_bias": "score modification",
    "softcap": "score modification",
    "causal": "mask",
    "sliding_window": "mask",
    "full": "mask",
    "block_sparse": "mask",
    "softmax": "normaliser",
    "relu_attention": "normaliser",
    "softmax_with_sinks": "normaliser",
}
SMALL = ["--arch", "interpreter", "--dtype", "float32", "--head-dim", "32"]


@af.attention
def windowed(q, k, v, window=64):
    """A test program with a static extra argument that has a default."""
    s = af.scaled_dot_product(q, k, scale=0.5)
    s = af.sliding_window(s, left=window)
    return af.softmax(s) @ v


@af.attention
def needs_bias(q, k, v, bias):
    s = af.scaled_dot_product(q, k)
    s = af.additive_bias(s, bias)
    return af.softmax(s) @ v


@af.attention
def sparse(q, k, v, block_mask):
    return af.softmax(af.block_sparse(af.scaled_dot_product(q, k), block_mask)) @ v


@af.attention
def rope_tables(q, k, v, cos, sin):
    return af.softmax(af.causal(af.rope(q, k, cos=cos, sin=sin))) @ v


@af.attention
def rope_optional_tables(q, k, v, cos=None, sin=None):
    return af.softmax(af.causal(af.rope(q, k, cos=cos, sin=sin))) @ v


@af.attention
def with_sinks(q, k, v, sinks, left=3):
    return af.softmax_with_sinks(af.sliding_window(af.scaled_dot_product(q, k), left), sinks) @ v


@af.attention
def needs_window(q, k, v, left):
    return af.softmax(af.sliding_window(af.scaled_dot_product(q, k), left)) @ v


not_a_program = 42


@pytest.fixture(autouse=True)
def _kernel_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "kernels"))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ---------------------------------------------------------------------------------------------- examples

def test_examples_are_programs():
    assert set(EXAMPLES) == {"llama", "gpt2", "mistral", "alibi", "relu"}
    for name, program in EXAMPLES.items():
        assert isinstance(program, AttentionProgram)
        assert program.fn.__name__ == name and program.fn.__doc__
        program.graph()  # traces with no extra arguments
    assert "rope" in ir.render(EXAMPLES["llama"].graph())
    assert "sliding_window(left=4095, right=0)" in ir.render(EXAMPLES["mistral"].graph())


# -------------------------------------------------------------------------------------------------- list

def test_list_shows_every_builtin_with_role_and_distribution(capsys):
    code, out, err = run(capsys, "list")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "ROLE", "DISTRIBUTION", "DESCRIPTION"]
    rows = {line.split()[0]: line for line in lines[1:] if line.strip() and not line[0].isdigit()}
    for name, role in BUILTINS.items():
        assert name in rows, f"{name} missing from `attnfuse list`"
        cells = rows[name].split("  ")
        cells = [c.strip() for c in cells if c.strip()]
        assert cells[:3] == [name, role, "attnfuse"], rows[name]
        assert len(cells) == 4 and cells[3]  # the doc's first line
    assert "Rotary position embedding" in rows["rope"]


def test_list_is_sorted_by_role_then_name(capsys):
    _, out, _ = run(capsys, "list")
    roles = {r.value: i for i, r in enumerate(Role)}
    keys = []
    for line in out.splitlines()[1:]:
        if not line.strip() or line[0].isdigit():
            continue
        cells = [c.strip() for c in line.split("  ") if c.strip()]
        keys.append((roles[cells[1]], cells[0]))
    assert keys == sorted(keys) and len(keys) >= len(BUILTINS)


# -------------------------------------------------------------------------------------------------- show

def test_show_example(capsys):
    code, out, err = run(capsys, "show", "llama", *SMALL)
    assert code == 0, err
    graph = llama.graph()
    assert "%0 = ScoreOp rope(theta=10000.0" in out
    assert ir.signature(graph) in out
    assert "arch=interpreter dtype=float32 head_dim=32 head_dim_v=32 group=1 save_lse=False" in out
    assert "block_m=" in out and "num_warps=" in out
    assert "def attnfuse_fwd_" in out
    path = Path(out.split("# path")[1].split("\n")[0].strip())
    assert path.exists() and "def attnfuse_fwd_" in path.read_text()


def test_show_source_only_and_path_only(capsys):
    code, source, _ = run(capsys, "show", "gpt2", *SMALL, "--source-only")
    assert code == 0 and source.startswith('"""Generated by AttnFuse')
    assert "# IR" not in source
    code, path, _ = run(capsys, "show", "gpt2", *SMALL, "--path-only")
    assert code == 0 and len(path.splitlines()) == 1
    assert Path(path.strip()).read_text().strip() == source.strip()


def test_show_options_reach_the_kernel_config(capsys):
    code, out, err = run(capsys, "show", "alibi", "--arch", "sm80", "--head-dim", "64", "--head-dim-v", "32",
                         "--group", "4", "--lse")
    assert code == 0, err
    assert "arch=sm80 dtype=bfloat16 head_dim=64 head_dim_v=32 group=4 save_lse=True" in out
    assert "alibi(slopes=None)" in out


def test_show_says_when_a_hopper_template_runs_the_kernel(capsys):
    for kernel, template, name in (("forward", "hopper_kernel.py", "fwd"), ("dkdv", "hopper_dkdv_kernel.py", "dkdv")):
        code, out, err = run(capsys, "show", "gpt2", "--arch", "sm90", "--group", "4", "--kernel", kernel)
        assert code == 0, err
        assert "# hopper     causal=True: on tensors TMA can address" in out, out
        assert f"attnfuse/runtime/{template}" in out and f"def attnfuse_{name}_" in out
    for argv in (("gpt2", "--arch", "sm80"), ("alibi", "--arch", "sm90"), ("gpt2", "--arch", "sm90", "--kernel", "dq")):
        code, out, err = run(capsys, "show", *argv)
        assert code == 0 and "# hopper" not in out, (argv, err)


def test_show_module_attribute(capsys):
    code, out, err = run(capsys, "show", f"{__name__}:windowed", *SMALL)
    assert code == 0, err
    assert "scaled_dot_product(scale=0.5)" in out and "sliding_window(left=64, right=0)" in out
    assert ir.signature(windowed.graph()) in out
    assert "def attnfuse_fwd_" in out


@pytest.mark.parametrize("argv, message", [
    (["show", "nosuchexample"], "unknown example 'nosuchexample'"),
    (["show", f"{__name__}:not_a_program"], "not an AttentionProgram"),
    (["show", f"{__name__}:missing"], "has no attribute 'missing'"),
    (["show", "attnfuse_no_such_module:x"], "cannot import module 'attnfuse_no_such_module'"),
    (["show", "relu", "--lse", *SMALL], "log-sum-exp"),
    (["show", "llama", "--head-dim", "512"], "at most 256"),
])
def test_show_errors(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.startswith("attnfuse: error: ") and message in err


def test_usage_errors_exit_2(capsys):
    code, _, err = run(capsys, "show", "llama", "--arch", "gfx90a")
    assert code == 2 and "attnfuse show: error:" in err and "invalid arch" in err
    code, _, err = run(capsys)
    assert code == 2 and "attnfuse: error:" in err


def test_version(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"attnfuse {af.__version__}"


# -------------------------------------------------------------------------------------------------- demo

def test_demo_cpu(capsys):
    code, out, err = run(capsys, "demo", "--device", "cpu")
    assert code == 0, out + err
    assert "passed" in out and "max abs error" in out


def test_demo_cpu_reports_a_failed_check(capsys, monkeypatch):
    real = AttentionProgram.__call__
    monkeypatch.setattr(AttentionProgram, "__call__", lambda self, q, k, v: real(self, q, k, v) + 1e-3)
    code, out, _ = run(capsys, "demo", "--device", "cpu")
    assert code == 1 and "FAILED" in out and "passed" not in out


def test_demo_cpu_reports_a_kernel_that_raises(capsys, monkeypatch):
    def broken(self, q, k, v):
        raise RuntimeError("out of resource: shared memory")

    monkeypatch.setattr(AttentionProgram, "__call__", broken)
    code, out, err = run(capsys, "demo", "--device", "cpu")
    assert code == 1 and "FAILED" in out and "RuntimeError: out of resource: shared memory" in out
    assert "Traceback" not in out + err


# ---------------------------------------------------------------------------------------- as a program

def test_python_m_attnfuse_cli_list(tmp_path):
    done = subprocess.run([sys.executable, "-m", "attnfuse.cli", "list"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert all(name in done.stdout for name in BUILTINS)


def test_importing_examples_prints_nothing(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import attnfuse.examples"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == ""


@pytest.mark.parametrize("kind,title", [("decode", "split-KV decoding kernel"), ("dkdv", "dK/dV kernel"),
                                        ("dq", "dQ kernel")])
def test_show_other_kernels(capsys, kind, title):
    assert main(["show", "llama", "--arch", "interpreter", "--dtype", "float32", "--head-dim", "32",
                 "--kernel", kind, "--source-only"]) == 0
    assert f"Generated by AttnFuse: {title}" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------- edges

@pytest.mark.parametrize("exit_line", ["import sys; sys.exit(0)", "import sys; sys.exit()", "raise SystemExit",
                                       "import sys; sys.exit(3)", "import sys; sys.exit('usage: script.py')"])
def test_show_reports_a_module_that_exits_at_import(capsys, tmp_path, monkeypatch, exit_line):
    module = f"attnfuse_exits_{abs(hash(exit_line))}"
    (tmp_path / f"{module}.py").write_text(f"import attnfuse as af\n{exit_line}\n")
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "show", f"{module}:program", *SMALL)
    assert code == 2 and out == ""
    assert err.startswith(f"attnfuse: error: module {module!r} exited while it was imported (SystemExit, code ")
    assert "before `show` could read 'program'" in err and "if __name__ ==" in err
    assert len(err.strip().splitlines()) == 1 and module not in sys.modules


@pytest.mark.parametrize("flag", ["--info", "--clear"])
@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_cache_command_on_a_path_that_is_no_directory_is_a_one_line_error(capsys, tmp_path, monkeypatch, flag,
                                                                           where):
    blocker = tmp_path / "kernels"
    blocker.write_text("not a directory")
    path = blocker if where == "a file" else blocker / "sub"
    monkeypatch.setenv(CACHE_ENV, str(path))
    code, out, err = run(capsys, "cache", flag)
    assert code == 2 and out == ""
    assert err.startswith("attnfuse: error: ") and len(err.strip().splitlines()) == 1
    assert str(path) in err and "$ATTNFUSE_CACHE_DIR" in err
    assert ("is not a directory" if where == "a file" else "Not a directory") in err
    assert blocker.read_text() == "not a directory"


DISTRIBUTION = re.compile(r"[A-Z0-9]|[A-Z0-9][A-Z0-9._-]*[A-Z0-9]", re.IGNORECASE)  # PEP 508 names


@pytest.mark.parametrize("name", ["größe", "naïve", "ñame", "名前", "ǆ", "window_", "Window", "2nd", "lambda",
                                  "prefix-lm", "a b", "_hidden"])
def test_new_refuses_a_name_no_package_can_carry(capsys, tmp_path, name):
    code, out, err = run(capsys, "new", name, "--role", "mask", "--dir", str(tmp_path / "pkg"))
    assert code == 2 and out == ""
    assert "NAME must be a lower-case Python identifier of ASCII letters a-z, digits and '_'" in err
    assert f"got {name!r}" in err
    assert not (tmp_path / "pkg").exists()


@pytest.mark.parametrize("name", ["w", "w2", "prefix_lm", "x_1y", "a__b", "window9"])
def test_new_writes_a_pyproject_that_parses_for_every_accepted_name(capsys, tmp_path, name):
    code, _, err = run(capsys, "new", name, "--role", "score_mod", "--dir", str(tmp_path / "pkg"))
    assert code == 0, err
    meta = tomllib.loads((tmp_path / "pkg" / "pyproject.toml").read_text())
    assert DISTRIBUTION.fullmatch(meta["project"]["name"])
    assert meta["project"]["entry-points"]["attnfuse"] == {name: f"attnfuse_{name}"}


# ------------------------------------------------------------------------------- show: runtime inputs

N, D = 32, 32


def _tables():
    return {"cos": torch.randn(N, D), "sin": torch.randn(N, D)}


RUNTIME_PROGRAMS = [  # (program, show's extra options, the same call's real extra arguments)
    ("needs_bias", [], lambda: {"bias": torch.randn(1, 2, N, N)}),
    ("sparse", [], lambda: {"block_mask": af.BlockMask.from_blocks(torch.rand(1, 2, 2, 2) < 0.7, N, N, 16)}),
    ("rope_tables", [], _tables),
    ("rope_optional_tables", ["--input", "cos", "--input", "sin"], _tables),
    ("rope_optional_tables", [], dict),
    ("with_sinks", [], lambda: {"sinks": torch.randn(2)}),
    ("with_sinks", ["--arg", "left=5"], lambda: {"sinks": torch.randn(2), "left": 5}),
    ("needs_window", ["--arg", "left=7"], lambda: {"left": 7}),
]


@pytest.mark.parametrize("kernel", ["forward", "dkdv"])
@pytest.mark.parametrize("name, options, extra", RUNTIME_PROGRAMS,
                         ids=[f"{n}{'-' if o else ''}{'-'.join(o)}" for n, o, _ in RUNTIME_PROGRAMS])
def test_show_traces_runtime_inputs_as_a_call_with_tensors_does(capsys, name, options, extra, kernel):
    """`show` of a program with runtime tensor arguments prints the kernel a call with real tensors compiles."""
    program = globals()[name]
    code, out, err = run(capsys, "show", f"{__name__}:{name}", *SMALL, *options, "--kernel", kernel)
    assert code == 0, err
    values = extra()
    q, k, v = (torch.randn(1, 2, N, D) for _ in range(3))
    assert ir.signature(program.graph(**values)) in out
    expected = program.source(q, k, v, **values, kernel=kernel)
    assert out.split("# source\n", 1)[1] == expected + ("" if expected.endswith("\n") else "\n")
    runtime = [n for n, value in values.items() if not isinstance(value, int)]
    for argument in runtime:
        assert f"{argument}=<runtime input>" in out.split("\n")[1]


@pytest.mark.parametrize("argv, message", [
    (["needs_window"], r"sliding_window: parameter 'left' is static .*got the input 'left'.*`show` traced "
                       r".*:needs_window with left as runtime input\(s\); give a static argument's value with "
                       r"--arg NAME=VALUE"),
    (["needs_bias", "--arg", "bais=1"], r"--arg/--input: 'bais' is no argument of the program: .*:needs_bias "
                                        r"takes the extra argument\(s\) bias"),
    (["needs_window", "--input", "right"], r"'right' is no argument of the program: .* takes the extra "
                                           r"argument\(s\) left"),
    (["needs_window", "--arg", "left"], r"--arg: expected NAME=VALUE, got 'left'"),
    (["needs_window", "--arg", "left=1+"], r"--arg: VALUE '1\+' is not a Python literal"),
    (["needs_window", "--arg", "left=[1]"], r"argument 'left' must be a tensor, a BlockMask, or a static"),
    (["needs_window", "--arg", "left=2", "--input", "left"], r"--input left: 'left' has a static value"),
    (["needs_bias", "--arg", "bias=0.5"], r"additive_bias: parameter 'bias' is a runtime input"),
    (["llama", "--input", "cos"], r"'cos' is no argument of the program: .* takes no extra argument"),
])
def test_show_arguments_errors_name_the_argument_and_what_is_allowed(capsys, argv, message):
    name, *options = argv
    spec = name if name in EXAMPLES else f"{__name__}:{name}"
    code, out, err = run(capsys, "show", spec, *SMALL, *options)
    assert code == 2 and out == ""
    assert err.startswith("attnfuse: error: ") and re.search(message, err), err


def test_show_a_third_party_plugin_with_a_runtime_tensor(capsys, tmp_path, monkeypatch):
    """A package as `attnfuse new ... --role score_mod` writes it (a runtime (Hq,) tensor), registered, and a
    program in a module of its author's: `show` prints the kernel a call with the tensor compiles."""
    import importlib.util

    from attnfuse.scaffold import scaffold

    root = scaffold("shown_head_weights", "score_mod", tmp_path / "pkg")
    module = "attnfuse_shown_head_weights"
    spec = importlib.util.spec_from_file_location(module, root / f"{module}.py")
    plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin)
    (tmp_path / "shown_models.py").write_text(
        "import attnfuse as af\n\n\n@af.attention\ndef weighted(q, k, v, weights):\n"
        "    return af.softmax(af.shown_head_weights(af.causal(af.scaled_dot_product(q, k)), weights)) @ v\n")
    monkeypatch.chdir(tmp_path)
    af.register_plugin(plugin, name="test-show-third-party")
    try:
        code, out, err = run(capsys, "show", "shown_models:weighted", *SMALL)
        assert code == 0, err
        program = sys.modules["shown_models"].weighted
        q, k, v = (torch.randn(1, 2, N, D) for _ in range(3))
        weights = torch.randn(2)
        assert "shown_head_weights(weights=weights)" in out and "# arguments  weights=<runtime input>" in out
        assert out.split("# source\n", 1)[1] == program.source(q, k, v, weights)
    finally:
        af.unregister_plugin("test-show-third-party")
        sys.modules.pop("shown_models", None)
