"""plait's packages import each other one way (issue 45): no cycle between the top-level packages and modules
of ``plait`` (a lazy import inside a function counts: it is an arrow all the same), and no module-level
``__getattr__`` re-export shims. Read from the source with ``ast``: nothing is imported."""

import ast
from pathlib import Path

import plait

ROOT = Path(plait.__file__).parent


def _part(module: str) -> str | None:
    """The top-level package or module of ``plait`` that dotted ``module`` lies in (None outside plait)."""
    parts = module.split(".")
    if parts[0] != "plait" or len(parts) < 2:
        return None
    return parts[1] if (ROOT / parts[1]).is_dir() or (ROOT / f"{parts[1]}.py").exists() else None


def import_graph() -> dict[str, set[str]]:
    """Top-level part -> the parts its modules import (every import statement, at any depth)."""
    edges: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        me = _part(".".join(path.relative_to(ROOT.parent).with_suffix("").parts))
        if me is None:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            edges.setdefault(me, set()).update(p for p in map(_part, names) if p not in (None, me))
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one part (Tarjan, 1972)."""
    index, low, stack, out = {}, {}, [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_cycle_between_plaits_packages():
    edges = import_graph()
    assert "models" not in edges["layers"]  # the shared layers never ask a family how to wire
    assert cycles(edges) == []


def test_only_the_edges_import_the_engine():
    edges = (
        import_graph()
    )  # the core packages never reach up into plait.engine; "__init__" is plait.initialize
    assert sorted(p for p, to in edges.items() if "engine" in to) == ["__init__", "trl"]


def test_the_check_finds_a_cycle():
    assert cycles({"layers": {"parallel", "models"}, "models": {"layers"}, "parallel": set()}) == [
        ["layers", "models"]
    ]


def test_no_module_level_getattr_shims():
    shims = [
        str(p.relative_to(ROOT))
        for p in ROOT.rglob("*.py")
        if any(
            isinstance(n, ast.FunctionDef) and n.name == "__getattr__"
            for n in ast.parse(p.read_text(encoding="utf-8")).body
        )
    ]
    assert shims == []
