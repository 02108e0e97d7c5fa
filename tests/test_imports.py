"""Layer contracts, read from the source with ``ast``: every import counts (relative ones, and
those inside functions or under ``if TYPE_CHECKING:``: a cycle in the types is a cycle in the
design).

The rules, each a function from the import graph to its violations, each with a canary (a
small graph or source that breaks it) proving that it can fail:

- LAYERS declares the folders from the top down; a folder imports only folders below its own
  rank (never one above, nor another of the same rank), the top-level leaves at the bottom.
- No import cycle between modules.
- core/ imports no torch: not directly, and importing every core module loads none.
- The engine reaches the workers only through the executor interface (``executor.abstract``
  and ``executor.factory``), never a worker, model, layer or kernel module.
- The front end (gRPC and HTTP servers, the daemon, the CLI, the engine clients) loads no
  torch, and the gRPC servicer and the daemon app reach the engine only through
  ``engine_client``.
- One module builds the one BlockManager (the scheduler, its owner).
- The engine core starts without the model stack: importing it loads no torch, model, layer,
  kernel, quantization, worker or sampling module (the executor's backends bring them).
- Below the engine nothing imports ``EngineConfig``: the engine splits it once into the
  layers' own configurations (``RunnerConfig``, ``SchedulerConfig``: engine/layer_configs.py).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "pydaemon"

# From the top down. A folder may import folders of a larger rank (below it) only; a rank may
# hold several folders, which then must not import one another. Top-level modules (the plain
# data every layer shares) sit at the bottom; the generated protobuf code beside them.
LAYERS: list[tuple[str, ...]] = [
    ("entrypoints",),  # cli, the offline LLM
    ("entrypoints.daemon",),
    ("entrypoints.grpc", "entrypoints.openai"),
    ("entrypoints.common",),
    ("engine",),
    ("executor", "structured_output"),
    ("worker",),
    ("worker.spec_decode",),
    ("model_loader",),
    ("models",),
    ("layers.lora",),
    ("layers.moe",),
    ("layers",),
    ("quantization",),
    ("ops",),
    ("tokenizer",),
    ("gguf",),
    ("sampling",),
    ("core.sched",),
    ("core",),
    ("distributed",),
    ("config",),
    ("leaves",),  # sampling_params, lora_request, generate_request, outputs, heap_freeze
    ("proto", "proto.pagedd", "proto.pagedd.v1"),  # generated; the packages are empty
]
LEAF_FOLDER = "leaves"
# The package's own façade and ``python -m pydaemon``: above every layer by definition.
ENTRY_MODULES = {"pydaemon", "pydaemon.__main__"}
# The compiled module (cpp/bindings): an editable or wheel install keeps it, and its stub,
# outside the source tree, so it is named here as well as found by its stub.
EXTENSION_MODULES = {"pydaemon._core"}
# What the engine may import of the executor/ folder: its interface and factory.
EXECUTOR_INTERFACE = {"pydaemon.executor.abstract", "pydaemon.executor.factory"}
# Folders the engine never imports: the device side, reached through the executor only.
DEVICE_SIDE = ("worker", "models", "layers", "ops", "quantization", "distributed", "executor")
# What the engine core must not load at import: the model stack, reached through the executor.
MODEL_STACK = (
    "torch",
    "pydaemon.models",
    "pydaemon.layers",
    "pydaemon.ops",
    "pydaemon.quantization",
    "pydaemon.worker",
    "pydaemon.sampling",
    "pydaemon.model_loader.loader",
)
# The lowest folder that reads EngineConfig (config/, which defines it, aside).
ENGINE_CONFIG_FLOOR = "engine"


# ---- reading the graph ---------------------------------------------------------------------
def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}


def _extension_modules() -> set[str]:
    """Compiled modules: imported, never importing."""
    return EXTENSION_MODULES | {_module_name(p) for p in PACKAGE_DIR.rglob("*.pyi")}


def imports_of(source: str, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The pydaemon modules ``source`` (module ``module``) imports, anywhere in it: relative
    imports resolved against its package; ``from pkg import name`` counts as pkg.name when
    that is a module."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in modules else base)
    return {m for m in found if m == "pydaemon" or m.startswith("pydaemon.")}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules) | _extension_modules()
    return {
        name: imports_of(path.read_text(), name, path.name == "__init__.py", known) & set(modules)
        for name, path in modules.items()
    }


def folder_of(module: str) -> str:
    """pydaemon.core.sched.scheduler -> core.sched; a top-level module -> "leaves"; a package
    __init__ belongs to its own folder (callers pass the folder for packages)."""
    parts = module.split(".")[1:]
    return ".".join(parts[:-1]) or LEAF_FOLDER


def _folders_of_graph(graph: dict[str, set[str]]) -> dict[str, str]:
    modules = _modules()
    out = {}
    for name in graph:
        if name in ENTRY_MODULES:
            continue
        path = modules.get(name)
        is_package = path is not None and path.name == "__init__.py"
        out[name] = ".".join(name.split(".")[1:]) if is_package else folder_of(name)
    return out


# ---- the rules -----------------------------------------------------------------------------
def layer_violations(
    graph: dict[str, set[str]], folders: dict[str, str], layers: list[tuple[str, ...]]
) -> list[str]:
    """Imports that go up the declared layers or sideways within a rank; folders not declared."""
    rank = {folder: i for i, tier in enumerate(layers) for folder in tier}
    problems = []
    for folder in sorted(set(folders.values()) - set(rank)):
        problems.append(f"folder {folder!r} is not in LAYERS")
    for name, deps in sorted(graph.items()):
        src = folders.get(name)
        if src is None or src not in rank:
            continue
        for dep in sorted(deps):
            dst = folders.get(dep)
            if dst is None or dst == src or dst not in rank:
                continue
            if rank[dst] <= rank[src]:
                problems.append(f"{name} ({src}) imports {dep} ({dst}): not below it")
    return problems


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
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


def engine_violations(graph: dict[str, set[str]], folders: dict[str, str]) -> list[str]:
    """engine/ modules importing device-side modules other than the executor interface."""
    problems = []
    for name, deps in sorted(graph.items()):
        if folders.get(name) != "engine":
            continue
        for dep in sorted(deps):
            if dep in EXECUTOR_INTERFACE:
                continue
            top = folders.get(dep, "").split(".")[0]
            if top in DEVICE_SIDE:
                problems.append(f"{name} imports {dep}")
    return problems


def engine_config_importers(
    sources: dict[str, str], folders: dict[str, str], layers: list[tuple[str, ...]]
) -> list[str]:
    """Modules (name -> source) of the folders below ``ENGINE_CONFIG_FLOOR`` but config/ that
    import the name ``EngineConfig``, or its module whole (its constants may be imported)."""
    rank = {folder: i for i, tier in enumerate(layers) for folder in tier}
    floor = rank[ENGINE_CONFIG_FLOOR]
    found = []
    for name, source in sorted(sources.items()):
        folder = folders.get(name, "")
        if folder == "config" or rank.get(folder, -1) <= floor:
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                hit = any(a.name == "pydaemon.config.engine" for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                names = {a.name for a in node.names}
                hit = "EngineConfig" in names or (
                    node.module == "pydaemon.config" and "engine" in names
                )
            else:
                continue
            if hit:
                found.append(name)
                break
    return found


def direct_torch_imports(sources: dict[str, str]) -> list[str]:
    """Modules (name -> source) with an ``import torch`` or ``from torch ...`` anywhere."""
    found = []
    for name, source in sorted(sources.items()):
        for node in ast.walk(ast.parse(source)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            if any(n == "torch" or n.startswith("torch.") for n in names):
                found.append(name)
                break
    return found


def torch_loaded_by(modules: list[str]) -> list[str]:
    """The torch modules that importing ``modules`` (in a fresh interpreter) loads."""
    return loaded_by(modules, ("torch",))


def loaded_by(
    modules: list[str], packages: tuple[str, ...], stubs: tuple[str, ...] = ()
) -> list[str]:
    """The modules of ``packages`` that importing ``modules`` (in a fresh interpreter, with
    ``stubs`` replaced by empty modules) loads."""
    code = (
        "import importlib, sys, types\n"
        f"for s in {stubs!r}: sys.modules[s] = types.ModuleType(s)\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"packages = {packages!r}\n"
        "print('\\n'.join(sorted(m for m in sys.modules "
        "if any(m == p or m.startswith(p + '.') for p in packages))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=str(PACKAGE_DIR.parent),
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


# ---- the contracts --------------------------------------------------------------------------
def test_every_import_goes_down_the_declared_layers():
    graph = _graph()
    folders = _folders_of_graph(graph)
    assert "pydaemon.engine.engine_core" in graph["pydaemon.engine.llm_engine"]  # read at all
    assert layer_violations(graph, folders, LAYERS) == []


def test_the_layer_rule_can_fail():
    layers = [("top",), ("mid_a", "mid_b"), ("low",)]
    folders = {"a": "top", "b": "mid_a", "c": "mid_b", "d": "low", "e": "nowhere"}
    graph = {"a": {"b", "d"}, "b": {"d"}, "d": {"b"}, "c": {"b"}, "e": set()}
    problems = layer_violations(graph, folders, layers)
    assert any("d (low) imports b (mid_a)" in p for p in problems)  # up
    assert any("c (mid_b) imports b (mid_a)" in p for p in problems)  # sideways
    assert any("'nowhere' is not in LAYERS" in p for p in problems)
    assert len(problems) == 3


def test_relative_and_function_level_imports_are_read():
    source = (
        "from __future__ import annotations\n"
        "def f():\n"
        "    from ..worker import model_runner\n"
        "    from . import request\n"
        "    import pydaemon.ops\n"
    )
    modules = {"pydaemon.worker.model_runner", "pydaemon.core.request", "pydaemon.ops"}
    found = imports_of(source, "pydaemon.core.sched_x", False, modules)
    assert found == modules
    # a package's own relative import resolves against the package itself
    assert imports_of("from .request import Request", "pydaemon.core", True, modules) == {
        "pydaemon.core.request"
    }


def test_no_import_cycle():
    graph = _graph()
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_can_fail():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_core_imports_no_torch():
    """core/ is plain state: the scheduler, requests, messages run in a process without torch."""
    modules = _modules()
    core = {n: p.read_text() for n, p in modules.items() if n.startswith("pydaemon.core")}
    assert len(core) > 10
    assert direct_torch_imports(core) == []
    assert torch_loaded_by(sorted(core)) == []


def test_the_torch_rule_can_fail():
    assert direct_torch_imports({"a": "def f():\n    from torch import nn\n", "b": "x = 1"}) == [
        "a"
    ]
    assert "torch" in torch_loaded_by(["pydaemon.worker.async_output"])


def test_the_engine_core_starts_without_the_model_stack():
    """The engine core reads the model's config (model_loader/model_paths.py) and reaches the
    ranks through the executor interface: importing it (and its process's entry) loads no
    torch, model, layer, kernel, quantization, worker or sampling module. xgrammar, which
    imports torch itself, is stubbed: the structured outputs it serves are the engine core's
    one user of torch."""
    engine_core = ["pydaemon.engine.engine_core", "pydaemon.engine.core_proc"]
    assert loaded_by(engine_core, MODEL_STACK, stubs=("xgrammar",)) == []


def test_the_model_stack_rule_can_fail():
    assert loaded_by(["pydaemon.model_loader.loader"], MODEL_STACK, stubs=("xgrammar",)) != []


def test_the_engine_reaches_workers_only_through_the_executor_interface():
    graph = _graph()
    folders = _folders_of_graph(graph)
    assert "pydaemon.executor.abstract" in graph["pydaemon.engine.engine_core"]  # read at all
    assert engine_violations(graph, folders) == []


def test_the_executor_rule_can_fail():
    folders = {
        "pydaemon.engine.x": "engine",
        "pydaemon.worker.model_runner": "worker",
        "pydaemon.executor.multiproc_executor": "executor",
        "pydaemon.executor.abstract": "executor",
    }
    graph = {"pydaemon.engine.x": set(folders) - {"pydaemon.engine.x"}}
    assert engine_violations(graph, folders) == [
        "pydaemon.engine.x imports pydaemon.executor.multiproc_executor",
        "pydaemon.engine.x imports pydaemon.worker.model_runner",
    ]


def test_nothing_below_the_engine_imports_engine_config():
    """The workers read their RunnerConfig, the scheduler its SchedulerConfig: a setting has
    one owner below the engine, which says so in engine/layer_configs.py."""
    modules = _modules()
    graph = _graph()
    folders = _folders_of_graph(graph)
    sources = {n: p.read_text() for n, p in modules.items() if n in folders}
    assert "pydaemon.worker.model_runner" in sources  # read at all
    assert engine_config_importers(sources, folders, LAYERS) == []


def test_the_engine_config_rule_can_fail():
    folders = {
        "pydaemon.worker.x": "worker",
        "pydaemon.worker.y": "worker",
        "pydaemon.core.z": "core",
        "pydaemon.core.w": "core",
        "pydaemon.engine.e": "engine",
        "pydaemon.config.runner": "config",
    }
    sources = {
        "pydaemon.worker.x": "from pydaemon.config.engine import EngineConfig\n",
        "pydaemon.worker.y": "from pydaemon.config.engine import KV_CACHE_DTYPES\n",
        "pydaemon.core.z": "def f():\n    import pydaemon.config.engine\n",
        "pydaemon.core.w": "from pydaemon.config import engine\n",
        "pydaemon.engine.e": "from pydaemon.config import EngineConfig\n",
        "pydaemon.config.runner": "from pydaemon.config.engine import EngineConfig\n",
    }
    assert engine_config_importers(sources, folders, LAYERS) == [
        "pydaemon.core.w",
        "pydaemon.core.z",
        "pydaemon.worker.x",
    ]


def test_nothing_below_the_entry_points_imports_them():
    for name, deps in _graph().items():
        if name.startswith("pydaemon.entrypoints") or name in ENTRY_MODULES:
            continue
        below = {d for d in deps if d.startswith("pydaemon.entrypoints")}
        assert not below, f"{name} imports {sorted(below)}"


def test_one_module_builds_the_block_manager():
    """The scheduler builds and alone owns the BlockManager."""
    files = [p for p in PACKAGE_DIR.rglob("*.py") if "proto" not in p.parts]
    builders = [
        p.relative_to(PACKAGE_DIR).as_posix() for p in files if "BlockManager(" in p.read_text()
    ]
    assert builders == ["core/sched/scheduler.py"]


def test_the_server_reaches_the_engine_only_through_engine_client():
    graph = _graph()
    allowed_outside = {
        "pydaemon",  # __version__
        "pydaemon.engine.engine_client",
        "pydaemon.generate_request",  # plain data: the request the server hands the engine
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
    front_end = [
        "pydaemon.entrypoints.cli",
        "pydaemon.engine.mp_client",
        "pydaemon.engine.inproc_client",
        "pydaemon.entrypoints.daemon.app",
        "pydaemon.entrypoints.openai.app",
        "pydaemon.entrypoints.grpc.servicer",
        "pydaemon.tokenizer.sentencepiece",
        "pydaemon.config.model",
    ]
    assert torch_loaded_by(front_end) == []
