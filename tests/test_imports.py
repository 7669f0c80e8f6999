"""The import graph of ``src/fp8jax``: no cycles, and the lower layers import no Flax layer.

Parsed from the source (``ast``), so that an import inside a function
counts as much as one at the top of a module: a function-level import that
only hides a cycle is still a cycle in the design (docs/design.md's layering).
Imports under ``if TYPE_CHECKING:`` are left out; they never run.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "fp8jax"
# The layers below Flax import nothing from fp8jax.flax; the ops and kernels
# not even Flax itself (sharding.use_mesh sets Flax's logical-axis rules).
BELOW_FLAX = ("fp8jax.ops", "fp8jax.kernels", "fp8jax.sharding", "fp8jax.axes")
NO_FLAX_AT_ALL = ("fp8jax.ops", "fp8jax.kernels", "fp8jax.axes")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """The modules ``name`` imports, fp8jax's and others', at any depth of its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                # `from pkg import mod` imports the submodule pkg.mod where there is one.
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in MODULES else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found


GRAPH = {
    name: {m for m in _imports(name, path) if m in MODULES and m != name}
    for name, path in MODULES.items()
}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
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
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return components


def test_the_graph_is_parsed():
    # A parser that found nothing would pass every check below.
    assert len(MODULES) > 40
    assert "fp8jax.ops.quantizing" in GRAPH["fp8jax.ops.layernorm_mlp"]
    assert "fp8jax.recipes" in GRAPH["fp8jax.scaling"]


def test_no_import_cycle():
    cycles = _cycles(GRAPH)
    assert not cycles, f"import cycles among fp8jax's modules: {cycles}"


def test_cycle_detection_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _flax_imports(name: str) -> list[str]:
    imported = _imports(name, MODULES[name])
    forbidden = ("fp8jax.flax",) + (("flax",) if name.startswith(NO_FLAX_AT_ALL) else ())
    return sorted(m for m in imported if any(m == f or m.startswith(f + ".") for f in forbidden))


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith(BELOW_FLAX)))
def test_lower_layers_import_no_flax(name):
    assert not _flax_imports(name), f"{name} imports {_flax_imports(name)}; it is below Flax"


# What the kernels may import: each other and the layers below them (formats,
# recipes, scale arithmetic, the saturating cast, the activations' math).
BELOW_KERNELS = ("fp8jax.kernels", "fp8jax.formats", "fp8jax.recipes", "fp8jax.scaling",
                 "fp8jax.quantize", "fp8jax.activations")  # fmt: skip


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("fp8jax.kernels")))
def test_kernels_import_only_the_layers_below_them(name):
    # The dispatcher decides for the ops, and the kernels serve them: neither
    # may depend on the ops or on anything that imports the kernels
    # (block_gemm once imported the fine-grained quantizers, a kernel's caller).
    above = sorted(m for m in GRAPH[name] if m.startswith("fp8jax") and not any(
        m == b or m.startswith(b + ".") for b in BELOW_KERNELS))  # fmt: skip
    assert not above, f"{name} imports {above}, which are not below the kernels"


def test_the_layers_below_the_kernels_import_no_kernel():
    below = [b for b in BELOW_KERNELS if b != "fp8jax.kernels"]
    wrong = {b: sorted(m for m in GRAPH[b] if m.startswith(("fp8jax.kernels", "fp8jax.ops")))
             for b in below}  # fmt: skip
    assert not any(wrong.values()), f"below the kernels, yet importing them or the ops: {wrong}"


def test_flax_check_sees_flax_imports():
    # A Flax module imports fp8jax.flax: the check must see that to mean anything.
    assert "fp8jax.flax._common" in _flax_imports("fp8jax.flax.linen.dense")
