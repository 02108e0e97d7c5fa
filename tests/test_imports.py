"""Import structure, read with ``ast``: no import cycle between modules and no loop between
folders (each folder is a layer: it imports only folders below it), ``ops/`` imports nothing
above itself, nothing below the entry points imports them, the top-level modules are leaves,
the gRPC servicer and the daemon app reach the engine only through the EngineClient interface,
and the package keeps its size rules."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "pydaemon"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}


# The compiled module (cpp/bindings): an editable or wheel install keeps it, and its stub,
# outside the source tree, so it is named here as well as found by its stub.
EXTENSION_MODULES = {"pydaemon._core"}


def _extension_modules() -> set[str]:
    """Compiled modules: imported, never importing."""
    return EXTENSION_MODULES | {_module_name(p) for p in PACKAGE_DIR.rglob("*.pyi")}


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The pydaemon modules ``path`` imports anywhere (inside functions and under
    ``if TYPE_CHECKING:`` too: a cycle in the types is a cycle in the design);
    ``from pkg import name`` counts as pkg.name when that is a module."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in modules else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m == "pydaemon" or m.startswith("pydaemon.")}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules) | _extension_modules()
    return {name: _imports(path, known) & set(modules) for name, path in modules.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = dfs(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = dfs(node)
            if cycle:
                return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_pydaemon_has_no_import_cycle():
    graph = _graph()
    # the graph is read at all
    assert "pydaemon.engine.engine_core" in graph["pydaemon.engine.llm_engine"]
    assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph))


# The package's own façade and ``python -m pydaemon``: above every layer by definition.
ENTRY_MODULES = {"pydaemon", "pydaemon.__main__"}


def _folder(module: str, modules: dict[str, Path]) -> str:
    """The folder (package) a module sits in: pydaemon.core.sched.scheduler -> core.sched; a
    package's __init__ belongs to the package itself; a top-level module is its own node."""
    parts = module.split(".")[1:]
    if modules[module].name == "__init__.py":
        return ".".join(parts)
    return ".".join(parts[:-1]) or parts[-1]


def _folder_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, deps in _graph().items():
        if name in ENTRY_MODULES:
            continue
        src = _folder(name, modules)
        for dep in deps:
            if dep in ENTRY_MODULES:
                continue
            dst = _folder(dep, modules)
            if dst != src:
                graph.setdefault(src, set()).add(dst)
    return graph


def test_no_folder_loop():
    graph = _folder_graph()
    assert "core.sched" in graph["worker"]  # the graph is read at all: the runner reads it
    assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph))


def test_top_level_modules_are_leaves():
    """The plain data at the top (sampling_params, outputs) imports no folder."""
    modules = _modules()
    graph = _graph()
    top = {m for m in modules if m.count(".") == 1 and modules[m].name != "__init__.py"}
    for name in sorted(top - ENTRY_MODULES):
        outside = graph[name] - top
        assert not outside, f"{name} imports {sorted(outside)}"


def test_ops_imports_nothing_above_itself():
    for name, deps in _graph().items():
        if name.startswith("pydaemon.ops"):
            above = {d for d in deps if not d.startswith("pydaemon.ops") and d != "pydaemon"}
            assert not above, f"{name} imports {sorted(above)}"


def test_nothing_below_the_entry_points_imports_them():
    for name, deps in _graph().items():
        if name.startswith("pydaemon.entrypoints") or name in ENTRY_MODULES:
            continue
        below = {d for d in deps if d.startswith("pydaemon.entrypoints")}
        assert not below, f"{name} imports {sorted(below)}"


def test_package_size_rules():
    """At most 12 top-level modules, none over 400 lines, and one module builds the one
    BlockManager (the scheduler, its owner)."""
    files = [p for p in PACKAGE_DIR.rglob("*.py") if "proto" not in p.parts]
    top = sorted(p.name for p in PACKAGE_DIR.glob("*.py"))
    assert len(top) <= 12, top
    lines = {p.relative_to(PACKAGE_DIR).as_posix(): len(p.read_text().splitlines()) for p in files}
    assert not {k: n for k, n in lines.items() if n > 400}
    builders = [
        p.relative_to(PACKAGE_DIR).as_posix() for p in files if "BlockManager(" in p.read_text()
    ]
    assert builders == ["core/sched/scheduler.py"]


def test_the_server_reaches_the_engine_only_through_engine_client():
    graph = _graph()
    allowed_outside = {
        "pydaemon",  # __version__
        "pydaemon.engine.engine_client",
        "pydaemon.entrypoints.grpc.validation",  # shared by gRPC and HTTP, no engine
        "pydaemon.heap_freeze",  # the process's garbage-collector policy, no engine
        "pydaemon.proto.pagedd.v1.generation_pb2",
        "pydaemon.proto.pagedd.v1.generation_pb2_grpc",
    }
    for name in ("pydaemon.entrypoints.grpc.servicer", "pydaemon.entrypoints.daemon.app"):
        outside = {m for m in graph[name] if not m.startswith("pydaemon.entrypoints")}
        assert outside, name
        assert outside <= allowed_outside, f"{name} imports {sorted(outside - allowed_outside)}"


def test_the_front_end_does_not_load_torch():
    """The daemon's front-end process (gRPC and HTTP servers, the engine client, the CLI) reads
    model configs, GGUF metadata and tokenizers but never tensors: importing it must not load
    torch (about a second and a few hundred MB at every start; the engine core loads it)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import pydaemon.entrypoints.cli, pydaemon.engine.mp_client, pydaemon.entrypoints.daemon.app\n"
        "import pydaemon.entrypoints.openai.app, pydaemon.tokenizer.sentencepiece, pydaemon.config.model\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "print(len(loaded))\n"
    )
    env_root = str(PACKAGE_DIR.parent)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=env_root, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0", "torch was imported by the front end"
