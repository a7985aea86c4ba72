"""Layers point one way (docs/ARCHITECTURE.md): the control plane imports neither the engine nor torch, the
backends import neither the engine nor each other, every module imports down the layer table (the registry's
users reach a backend through the registry), no module imports another's private (_name) name, and no import
circle runs across files. Read off every import statement of the package (lazy ones inside functions included),
not off what happens to be loaded."""

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


# the layer table of docs/ARCHITECTURE.md, lowest first: a module imports only from its own layer or one below. The
# users of the registry (the last layer) reach a backend only through it: they import no atlas.backends module.
LAYERS: list[tuple[str, ...]] = [
    ("atlas.errors", "atlas.hashing", "atlas.version", "atlas.threads"),
    ("atlas.config",),
    ("atlas.sampling.params",),
    ("atlas.plan",),
    ("atlas.state",),
    ("atlas.model",),
    ("atlas.sampling",),
    ("atlas.backends",),
    ("atlas.engine", "atlas.replay.store", "atlas.replay.codec", "atlas.replay.rows", "atlas.replay.reader",
     "atlas.replay.sqlite_file", "atlas.replay.run_rows"),
    ("atlas.registry",),
    ("atlas.bench", "atlas.bench_measure", "atlas.bench_variants", "atlas.calibrate"),
    ("atlas", "atlas.replay", "atlas.server", "atlas.cli", "atlas.cli_bench", "atlas.cli_checks", "atlas.cli_support",
     "atlas.llm"),
]
REGISTRY_USERS = len(LAYERS) - 1


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest entry `module` is under."""
    best = max(((len(name), i) for i, names in enumerate(LAYERS) for name in names if _under(module, name)),
               default=None)
    assert best is not None, f"{module} is in no layer of LAYERS (docs/ARCHITECTURE.md): add it"
    return best[1]


def test_every_module_imports_down_the_layer_table() -> None:
    graph = import_graph()
    # a package whose __init__ imports nothing (`from atlas.replay import codec` runs it) belongs to no layer
    empty = {m for m, ts in graph.items() if not ts and (ROOT / m.replace(".", "/") / "__init__.py").exists()}
    upward = []
    for module, targets in sorted(graph.items()):
        if not _under(module, "atlas"):
            continue
        mine = layer_of(module)
        for target in sorted(t for t in targets if _under(t, "atlas") and t not in empty):
            theirs = layer_of(target)
            if theirs > mine or (mine == REGISTRY_USERS and _under(target, "atlas.backends")):
                upward.append(f"{module} (layer {mine}) imports {target} (layer {theirs})")
    assert not upward, "\n".join(upward)


def private_imports(text: str, own: str, modules: set[str]) -> list[tuple[int, str]]:
    """(line, M._name) of each `from M import _name` (or `import M._name`) in `text` where M is a module of the
    package and _name is not a private submodule of the importer's (`own`) package: another module's private name."""
    bad = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found = [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found = [(a.name.rsplit(".", 1)[0], a.name.rsplit(".", 1)[1]) for a in node.names if "." in a.name]
        else:
            continue
        for module, name in found:
            if module.split(".")[0] not in ("atlas", "atlas_kernels") or not name.startswith("_"):
                continue
            if name.startswith("__") and name.endswith("__"):
                continue
            if f"{module}.{name}" in modules and own and _under(own, module):  # its own package's private module
                continue
            bad.append((node.lineno, f"{module}.{name}"))
    return bad


def test_no_module_imports_another_modules_private_name() -> None:
    modules = set(import_graph())
    bad = []
    for top in ("atlas", "kernels", "tests", "benchmarks", "tools"):
        for path in (ROOT / top).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            own = _module(path) if top in ("atlas", "kernels") else ""
            bad += [f"{path.relative_to(ROOT)}:{line}: {name}" for line, name in
                    private_imports(path.read_text(), own, modules)]
    assert not bad, "private names imported across modules (make the shared one public):\n" + "\n".join(bad)


def test_the_checks_see_a_private_import_and_place_each_layer() -> None:
    """The checks above catch what they are for: another module's private name (a package's own private module
    is its own), and the layers in the table's order."""
    modules = set(import_graph())
    text = ("from atlas.state.invariants import _holds\nimport atlas.replay._x\n"
            "from atlas_kernels import _interpreter_compat\nfrom atlas.state.invariants import check_sequence\n")
    assert private_imports(text, "atlas.state.probe", modules) == [
        (1, "atlas.state.invariants._holds"), (2, "atlas.replay._x"), (3, "atlas_kernels._interpreter_compat")]
    assert private_imports(text, "atlas_kernels.conv", modules) == [(1, "atlas.state.invariants._holds"),
                                                                     (2, "atlas.replay._x")]
    assert layer_of("atlas.state.machines") < layer_of("atlas.engine.engine") < layer_of("atlas.registry")
    assert layer_of("atlas.replay.store") < layer_of("atlas.registry") < layer_of("atlas.replay.verify")
    assert layer_of("atlas.server.serve") == REGISTRY_USERS


def test_no_module_of_the_package_is_over_400_lines() -> None:
    """No module of the package over 400 lines (issue 43): one past it is split by responsibility."""
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "atlas").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
