"""Layers point one way (docs/ARCHITECTURE.md): the control plane imports neither the engine nor torch, the
backends import neither the engine nor each other, and no import circle runs across files. Read off every
import statement of the package (lazy ones inside functions included), not off what happens to be loaded."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "kernels":
        parts[0] = "atlas_kernels"
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    files = [*(ROOT / "atlas").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]
    modules = {_module(p): p for p in files if "__pycache__" not in p.parts}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.add(node.module)
                targets.update(f"{node.module}.{a.name}" for a in node.names)
        # keep the edges to the package's own modules (a `from pkg import module` names the module)
        graph[name] = {t for t in targets if t in modules and t != name}
        graph[name] |= {t.rsplit(".", 1)[0] for t in targets if t not in modules and t.rsplit(".", 1)[0] in modules
                        and t.rsplit(".", 1)[0] != name}
    return graph


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_control_plane_imports_neither_the_engine_nor_torch() -> None:
    graph = import_graph()
    allowed = ("atlas", "atlas.errors", "atlas.hashing", "atlas.config", "atlas.plan", "atlas.sampling",
               "atlas.sampling.params", "atlas.state")
    for module, targets in graph.items():
        if _under(module, "atlas.state"):
            bad = [t for t in targets if not any(t == a or _under(t, "atlas.state") for a in allowed)]
            assert not bad, f"{module} imports {bad}"
    out = subprocess.run([sys.executable, "-c", "import atlas.state, atlas.state.control, sys; "
                          "print('torch' in sys.modules)"], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


def test_backends_import_neither_the_engine_nor_each_other() -> None:
    graph = import_graph()
    upper = ("atlas.engine", "atlas.replay", "atlas.server", "atlas.registry", "atlas.cli", "atlas.llm")
    for module, targets in graph.items():
        if not _under(module, "atlas.backends"):
            continue
        assert not [t for t in targets if any(_under(t, u) for u in upper)], (module, targets)
        for a, b in (("atlas.backends.cpu", "atlas.backends.cuda"), ("atlas.backends.cuda", "atlas.backends.cpu")):
            if _under(module, a):
                assert not [t for t in targets if _under(t, b)], (module, targets)


def test_no_import_circle_across_files() -> None:
    graph = import_graph()
    # package __init__ files re-export their own modules: an edge from a package to its children is not a layer
    edges = {m: {t for t in ts if not _under(t, m)} for m, ts in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                cycle = stack[stack.index(t):] + [t]
                raise AssertionError(f"import circle: {' -> '.join(cycle)}")
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
