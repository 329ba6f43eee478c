"""The import graph drawn from the code matches docs/architecture.md: no cycles, no upward arrows.

Every `import` and `from ... import` inside grpo_lab counts, at module level or inside a function (a lazy import is
still a dependency). Packages sit in layers; a module may import from its own package or from a lower layer only.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "grpo_lab"

# docs/architecture.md's table: the layer of each top-level unit of grpo_lab (higher imports lower, never the reverse;
# units in one layer never import each other). `lab` is the bottom: it holds the one reader of the environment.
LAYERS = {
    "cli": 6, "router": 6,
    "sweep": 5,
    "async_loop": 4,
    "serving": 3,
    "tasks": 2, "memory": 2,
    "loss": 1, "models": 1,
    "lab": 0,
}


# docs/architecture.md's serving rooms: a room imports only rooms in a lower row.
SERVING_ROOMS = {
    "clusters": 4,
    "router": 3,
    "tenancy": 2, "replicas": 2, "sim": 2,
    "routing": 1, "adapters": 1,
    "wire": 0,
}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _targets(module: str, path: Path, node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = module.split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    if node.level:
        base = base[: len(base) - node.level + 1]
        stem = ".".join(base + ([node.module] if node.module else []))
    else:
        stem = node.module or ""
    return [stem] + [f"{stem}.{alias.name}" for alias in node.names]


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in _targets(name, path, node):
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != name and target.startswith("grpo_lab"):
                    graph[name].add(target)
    return graph


def unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_unit_has_a_layer():
    units = {unit(m) for m in modules()} - {None, "__init__"}
    assert units <= set(LAYERS), f"grpo_lab/ holds {sorted(units - set(LAYERS))}, which docs/architecture.md lacks"


def test_no_import_cycles_between_modules():
    assert cycles(import_graph()) == []


def test_imports_point_down_the_layers():
    upward = []
    for source, targets in import_graph().items():
        for target in targets:
            a, b = unit(source), unit(target)
            if a is None or b is None or a == b:
                continue
            if LAYERS[b] >= LAYERS[a]:
                upward.append(f"{source} -> {target}")
    assert upward == []


def room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "serving" else None


def test_every_serving_module_is_in_a_room():
    loose = [str(p.relative_to(ROOT)) for p in (PACKAGE / "serving").glob("*.py") if p.name != "__init__.py"]
    assert loose == [], f"modules directly under grpo_lab/serving: {loose}"
    rooms = {room(m) for m in modules()} - {None}
    assert rooms == set(SERVING_ROOMS), f"rooms on disk {sorted(rooms)} vs docs/architecture.md {sorted(SERVING_ROOMS)}"


def test_serving_rooms_import_down_only():
    upward = []
    for source, targets in import_graph().items():
        for target in targets:
            a, b = room(source), room(target)
            if a is None or b is None or a == b:
                continue
            if SERVING_ROOMS[b] >= SERVING_ROOMS[a]:
                upward.append(f"{source} -> {target}")
    assert upward == []


def test_the_top_level_stays_small():
    entries = [p for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()]
    assert len([p for p in entries if p.name != "__init__.py"]) <= 10
    assert len([p for p in entries if p.suffix == ".py"]) <= 8


def test_the_architecture_page_lists_every_unit():
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`grpo_lab\.(\w+)`", text))
    assert set(LAYERS) <= named, f"docs/architecture.md does not name {sorted(set(LAYERS) - named)}"


@pytest.mark.parametrize("phrase", ["DESIGN.md", "seed 2", "seed's author", "seed article", "seed recipe", "the seed's"])
def test_the_project_speaks_of_itself(phrase):
    """Code and docs cite public sources by name, never the notes the project was started from."""
    places = [*PACKAGE.rglob("*.py"), *(ROOT / "docs").glob("*.md"), ROOT / "README.md",
              *(ROOT / "notebooks").glob("*.ipynb"), *(ROOT / "benchmarks").glob("*.py"),
              *(ROOT / "results").rglob("*.md")]
    hits = [str(p.relative_to(ROOT)) for p in places if phrase.lower() in p.read_text().lower()]
    assert hits == []
