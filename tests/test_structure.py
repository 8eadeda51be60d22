"""The import structure, read from the source with ``ast``: the runtime sees the compiler only through
``compile`` (and the Plan types, which live outside it), no module imports itself back, and plugins import
only what a plugin needs.

    python -m pytest -q tests/test_structure.py
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"attnfuse": ROOT / "attnfuse", "attnfuse_plugins": ROOT / "plugins"}

# What a plugin may import of AttnFuse: the plugin API, one module (its tests may import attnfuse.testing and
# attnfuse too). A built-in may also import another built-in (which imports only the plugin API). The plugin
# API imports neither the frontend, the compiler, the runtime nor the plugin manager; PLUGIN_API_MODULES
# are the modules it reaches, which stay importable for plugins written against them.
PLUGIN_API = "attnfuse.plugin"
PLUGIN_API_MODULES = {
    "attnfuse.hookspecs",
    "attnfuse.combinator",
    "attnfuse.fragments",
    "attnfuse.errors",
    "attnfuse.checks",
    "attnfuse.rotary",
    "attnfuse.device_cache",
    "attnfuse.block_mask",
    "attnfuse.examples_support",
    "attnfuse.launch_context",
    "attnfuse.tiles",
    "attnfuse.parsing",
}
OUTSIDE_PLUGIN_API = (
    "attnfuse.program",
    "attnfuse.dsl",
    "attnfuse.ir",
    "attnfuse.plugin_manager",
    "attnfuse.passes",
    "attnfuse.runtime",
    "attnfuse.testing",
)


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


class _Imports(ast.NodeVisitor):
    """Every import of one module: (target module, at module level, only for type checking)."""

    def __init__(self, name: str, is_package: bool):
        self.package = name if is_package else name.rpartition(".")[0]
        self.found: list[tuple[str, bool, bool]] = []
        self._depth = 0
        self._type_checking = 0

    def _add(self, target: str) -> None:
        self.found.append((target, self._depth == 0, self._type_checking > 0))

    def visit_FunctionDef(self, node) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        checking = isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        self._type_checking += checking
        for child in node.body:
            self.visit(child)
        self._type_checking -= checking
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parts = self.package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
        for alias in node.names:
            self._add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)


def _imports() -> dict[str, list[tuple[str, bool, bool]]]:
    imports = {}
    for name, path in MODULES.items():
        visitor = _Imports(name, path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text(), str(path)))
        imports[name] = [(t, top, typing) for t, top, typing in visitor.found if t in MODULES]
    return imports


IMPORTS = _imports()


def _in(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_runtime_sees_the_compiler_only_through_compile():
    """At most 2 (runtime file, compiler file) import pairs, none into codegen or lower, counting every
    import (in functions, and for type checking, too)."""
    pairs = {
        (source, target)
        for source, found in IMPORTS.items()
        if _in(source, "attnfuse.runtime")
        for target, _, _ in found
        if _in(target, "attnfuse.passes")
    }
    assert len(pairs) <= 2, sorted(pairs)
    assert not [p for p in pairs if _in(p[1], "attnfuse.passes.codegen", "attnfuse.passes.lower")], sorted(pairs)


def test_nothing_after_tracing_looks_a_combinator_up():
    """The runtime never asks the plugin manager anything; the compiler asks it only for tiles (the
    ``attnfuse_tile_config`` hook), in the tile pass."""
    askers = {
        source
        for source, found in IMPORTS.items()
        if _in(source, "attnfuse.runtime", "attnfuse.passes")
        for target, _, _ in found
        if target == "attnfuse.plugin_manager"
    }
    assert askers <= {"attnfuse.passes.tile"}, sorted(askers)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or of one importing itself (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    """No circle among the modules' imports: at module level, nor through an import inside a function (only
    ``TYPE_CHECKING``'s, which never run, are left out)."""
    edges = {source: {t for t, _, typing in found if not typing} for source, found in IMPORTS.items()}
    assert _cycles(edges) == []


def test_the_circle_check_finds_circles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"a"}}) == [["a"]] and _cycles({"a": {"b"}, "b": set()}) == []


BUILTINS = sorted(m for m in MODULES if _in(m, "attnfuse_plugins") and m != "attnfuse_plugins")


@pytest.mark.parametrize("plugin", BUILTINS)
def test_a_builtin_plugin_imports_only_the_plugin_api(plugin):
    """The plugin API, and other built-ins (softmax_with_sinks takes softmax's fragment as its partial one),
    which import only the plugin API themselves (and no circle: ``test_no_import_circle``)."""
    assert {target for target, _, _ in IMPORTS[plugin]} <= {PLUGIN_API, *BUILTINS}


def test_the_plugin_api_imports_nothing_else_of_attnfuse():
    """What the plugin API imports, at any depth (in functions too), is neither the frontend, the compiler,
    the runtime nor the plugin manager (nor the package itself, which imports all of them): the modules of
    PLUGIN_API_MODULES and nothing else."""
    reached, todo = set(), [PLUGIN_API]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += [t for t, _, typing in IMPORTS[module] if not typing]
    assert "attnfuse" not in reached and not [m for m in reached if _in(m, *OUTSIDE_PLUGIN_API)], sorted(reached)
    assert reached - {PLUGIN_API, "attnfuse.block_mask_checks", "attnfuse.lru", "attnfuse.static_values"} == (
        PLUGIN_API_MODULES
    )


def _attnfuse_imports(source: str) -> set[str]:
    """The attnfuse modules (and ``attnfuse_plugins`` ones) a plugin's source imports, at any depth."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        modules = (
            [node.module or ""]
            if isinstance(node, ast.ImportFrom) and not node.level
            else [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else []
        )
        found.update(m for m in modules if _in(m, "attnfuse", "attnfuse_plugins"))
    return found


PLUGIN_SOURCES = sorted(
    [
        *(ROOT / "contrib").rglob("*.py"),
        *(p for p in (ROOT / "attnfuse" / "scaffold").glob("*.txt") if p.name not in ("pyproject.txt", "readme.txt")),
    ],
    key=str,
)


@pytest.mark.parametrize("path", PLUGIN_SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_contrib_packages_and_the_scaffold_import_only_the_plugin_api(path):
    """A contrib package's modules and the scaffold's templates import only ``attnfuse.plugin``; their
    tests may import the conformance kit (``attnfuse.testing``) and the package that runs programs."""
    allowed = {PLUGIN_API}
    if "tests" in path.parts or path.name == "test.txt":
        allowed |= {"attnfuse", "attnfuse.testing"}
    assert _attnfuse_imports(path.read_text()) <= allowed


def test_the_plugin_manager_does_not_import_the_package():
    assert "attnfuse" not in {target for target, _, _ in IMPORTS["attnfuse.plugin_manager"]}


def test_distributed_reads_the_plan_not_the_compiler():
    """No module of ``attnfuse.distributed`` imports the compiler (``attnfuse.passes``): what a ring needs of
    a program, the Plan holds."""
    offenders = sorted(
        (source, target)
        for source, found in IMPORTS.items()
        if _in(source, "attnfuse.distributed")
        for target, _, _ in found
        if _in(target, "attnfuse.passes")
    )
    assert offenders == []


# Triton's private or experimental modules (all but its documented API: triton.jit, triton.language,
# triton.cdiv, triton.testing ...), which only attnfuse.triton_compat imports (Gluon included).
PRIVATE_TRITON = ("runtime", "compiler", "knobs", "backends", "experimental", "tools", "_C")
TRITON_COMPAT_EXEMPT = ("attnfuse.triton_compat",)


def _private_triton(tree: ast.AST) -> list[str]:
    """The private Triton names a module's source reaches: by ``import``, ``from ... import`` or an
    attribute of ``triton`` (``triton.runtime.driver``)."""
    reached = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            reached += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            reached += [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "triton":
            reached.append(f"triton.{node.attr}")
    return [name for name in reached if name.startswith("triton.") and name.split(".")[1] in PRIVATE_TRITON]


def test_only_the_compat_module_imports_private_triton():
    offenders = {
        module: found
        for module, path in MODULES.items()
        if _in(module, "attnfuse") and not _in(module, *TRITON_COMPAT_EXEMPT)
        for found in [_private_triton(ast.parse(path.read_text(), str(path)))]
        if found
    }
    assert offenders == {}


def test_the_private_triton_check_finds_every_spelling():
    source = "import triton.runtime.jit\nfrom triton import knobs\nfrom triton.compiler import ASTSource\nx = triton._C"
    assert _private_triton(ast.parse(source)) == [
        "triton.runtime.jit",
        "triton.knobs",
        "triton.compiler.ASTSource",
        "triton._C",
    ]
    public = "import triton\nimport triton.language as tl\nfrom triton.testing import do_bench\ntriton.jit(f)"
    assert _private_triton(ast.parse(public)) == []
