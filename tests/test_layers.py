"""The package graph of docs/architecture.md, checked on the source (function-level imports included).

Every ``import`` and ``from ... import`` anywhere in a module (at the top, in
a function, under ``if TYPE_CHECKING``) is an edge. Each module belongs to
one layer; a layer may import only the layers listed for it, and the module
graph has no cycle.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("tangram", "integrations", "profiling", "datasets_patch")

# module prefix -> layer (longest prefix wins)
LAYER_OF = {
    "tangram.core": "model",
    "tangram.core.engine": "engine",
    "tangram.core.records": "engine",
    "tangram.core.estimator": "engine",
    "tangram.core.queue": "engine",
    "tangram.core.running": "engine",
    "tangram.core.feasibility": "engine",
    "tangram.core.skips": "engine",
    "tangram.core.last_round": "engine",
    "tangram.core.offered": "engine",
    "tangram.core.restarts": "engine",
    "tangram.policy": "policy",
    "tangram.managers": "managers",
    "tangram.executors": "executors",
    "tangram.runtime": "runtime",
    "tangram.profiles": "model",
    "tangram.scaleout": "scaleout",
    "tangram.service": "service",
    "tangram.simulator": "simulator",
    "tangram.client": "client",
    "tangram": "apps",
    "integrations": "apps",
    "profiling": "apps",
    "datasets_patch": "apps",
}

# layer -> the layers it may import (besides itself); see docs/architecture.md
MAY_IMPORT = {
    "model": set(),
    "policy": {"model"},
    "managers": {"model"},
    "executors": {"model"},
    "engine": {"model", "policy", "managers"},
    "runtime": {"model", "policy", "managers", "executors", "engine"},
    "scaleout": {"model", "policy", "managers", "executors", "engine", "runtime"},
    "service": {"model", "policy", "managers", "executors", "engine", "runtime", "scaleout"},
    "simulator": {"model", "policy", "managers", "executors", "engine"},
    "client": set(),
    "apps": {"model", "policy", "managers", "executors", "engine", "runtime", "scaleout", "service",
             "simulator", "client"},
}

def _modules() -> dict[str, Path]:
    out = {}
    for top in PRODUCT:
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if "fixtures" in parts or "project" in parts:  # data shipped for tests and the demo, not product code
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The project modules ``name`` imports anywhere in its body."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:  # `import tangram.core.model as m`, `from x import function`
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def layer(module: str) -> str:
    best = max((p for p in LAYER_OF if module == p or module.startswith(p + ".")), key=len)
    return LAYER_OF[best]


def test_every_module_has_a_layer():
    assert MODULES, "no product modules found"
    for m in MODULES:
        assert layer(m) in MAY_IMPORT, m


def test_layers_import_only_what_they_may():
    wrong = []
    for m, deps in GRAPH.items():
        for d in deps:
            lm, ld = layer(m), layer(d)
            if ld != lm and ld not in MAY_IMPORT[lm]:
                wrong.append(f"{m} ({lm}) imports {d} ({ld})")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_allowed_layer_graph_has_no_cycle():
    seen: dict[str, int] = {}

    def visit(n: str, stack: list[str]) -> None:
        if seen.get(n) == 1:
            raise AssertionError(f"layer cycle: {' -> '.join(stack + [n])}")
        if seen.get(n) == 2:
            return
        seen[n] = 1
        for d in MAY_IMPORT[n]:
            visit(d, stack + [n])
        seen[n] = 2

    for n in MAY_IMPORT:
        visit(n, [])


def _skip_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's ``__init__`` re-exporting its modules is not a cycle with them."""
    return {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}


def test_no_module_import_cycle():
    graph = _skip_package_inits(GRAPH)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles = []

    def strong(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            strong(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_bottom_and_the_policy_import_nothing_heavy():
    heavy = {"aiohttp", "docker", "torch", "ray", "verl", "sklearn", "transformers"}
    bad = []
    for m, path in MODULES.items():
        if layer(m) not in ("model", "policy", "managers", "engine", "runtime"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{m} imports {n}" for n in names if n.split(".")[0] in heavy]
    assert not bad, bad


MAX_LINES = 500


def test_no_product_module_is_over_the_size_limit():
    big = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (split them by job): {big}"
