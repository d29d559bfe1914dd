"""The import layering of the package, checked with grimp (docs/design/passes.md).

Layers, highest first; a module may import only from its own layer or lower ones.
Siblings in one layer (``calibrate | report``, ``ir | models``) do not import each other.
Every import counts: module level, function level and ``TYPE_CHECKING`` blocks.

    cli
    calibrate | report
    runtime
    search
    cost
    passes
    rules
    ir | models
    display | errors | lazy | streams

``models`` (the zoo's ONNX builders) imports only ``errors``, ``lazy`` and ``streams``, so
it sits with ``ir``.
``display`` (how every command prints a step time or a memory size) imports nothing;
``lazy`` (the packages' names imported on first use) and ``streams`` (output paths that
are written through) import only the standard library.
``search`` sits above ``cost``: the search prices strategies with the cost model.
"""

from __future__ import annotations

import grimp
import networkx as nx
import pytest

PACKAGE = "tensoropt"
LAYERS = (
    "cli",
    grimp.Layer("calibrate", "report"),
    "runtime",
    "search",
    "cost",
    "passes",
    "rules",
    grimp.Layer("ir", "models"),
    grimp.Layer("display", "errors", "lazy", "streams"),
)
# Modules of the package root that are in no layer: the version string and ``python -m``.
OUTSIDE = {PACKAGE, f"{PACKAGE}.__main__"}


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(PACKAGE, cache_dir=None)


def _layer_names() -> set[str]:
    names: set[str] = set()
    for layer in LAYERS:
        names.update(layer.module_tails if isinstance(layer, grimp.Layer) else {layer})
    return names


def _chain(route: grimp.Route) -> str:
    heads = " | ".join(sorted(route.heads))
    tails = " | ".join(sorted(route.tails))
    return " -> ".join([heads, *route.middle, tails])


def test_every_top_level_module_has_a_layer(graph):
    top = {m for m in graph.modules if m.count(".") == 1} - OUTSIDE
    missing = sorted(m for m in top if m.split(".")[1] not in _layer_names())
    assert not missing, f"add these to LAYERS in {__file__}: {missing}"


def _violations(graph: grimp.ImportGraph) -> list[str]:
    illegal = graph.find_illegal_dependencies_for_layers(layers=LAYERS, containers={PACKAGE})
    return [
        f"{dep.importer} imports {dep.imported} (a higher layer): {_chain(route)}"
        for dep in sorted(illegal, key=lambda d: (d.importer, d.imported))
        for route in dep.routes
    ]


def test_imports_follow_the_layers(graph):
    lines = _violations(graph)
    assert not lines, "layering violations:\n" + "\n".join(lines)


def test_no_import_cycles(graph):
    """No two modules depend on each other, through any chain (TYPE_CHECKING included)."""
    edges = nx.DiGraph()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            edges.add_edge(module, imported)
    cycles = [" -> ".join([*c, c[0]]) for c in nx.simple_cycles(edges)]
    assert not cycles, "import cycles:\n" + "\n".join(sorted(cycles)[:20])


def test_the_check_reports_a_violation_with_its_chain():
    """The layer test can fail: a low module importing a high one is reported with its chain."""
    graph = grimp.build_graph(PACKAGE, cache_dir=None)
    graph.add_import(importer="tensoropt.ir.mesh", imported="tensoropt.passes.plans")
    lines = _violations(graph)
    assert any(
        line.startswith("tensoropt.ir imports tensoropt.passes")
        and line.endswith("tensoropt.ir.mesh -> tensoropt.passes.plans")
        for line in lines
    ), lines
