"""bench/moe_routing.py's controlled routing installed in vLLM, as a vLLM general plugin: vLLM
loads the ``vllm.general_plugins`` entry points in every process it starts (the engine core
and its workers included) before it builds the model, so the hooks are in place before the
dummy weights are drawn, torch.compile traces and the CUDA graphs are captured.

``write_plugin_dist(directory)`` writes a ``.dist-info`` declaring the entry point; the
directory goes on sys.path and PYTHONPATH (bench/throughput_vllm.py does it). The hooks,
configured through moe_routing's environment variables:

- ``DummyModelLoader.load_weights``: after vLLM's dummy draws, every MoE router weight
  (``model.layers.{l}.*.gate.weight`` [E, H], layer order) becomes
  ``moe_routing.router_weight(l, ...)``, the draw pagedd's hook loads;
- ``BaseRouter.select_experts`` (vLLM's routers since the fused_moe/router refactor): records
  the ids it returns (moe_routing.RoutingStats; the routers are called inside the MoE custom
  op, so captured graphs replay the counters too);
- ``Worker.pagedd_routing(op)``: "reset" or "read" the counters through
  ``LLM.collective_rpc("pagedd_routing", args=(op,))`` (a method name: no pickled callable).

What vLLM version lacks a hook is said in the result (``hooks``), never guessed around.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from bench import moe_routing

DIST_NAME = "pagedd_bench_moe_routing"
_GATE = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight$")


class _State:
    installed = False
    hooks: dict[str, str] = {}
    num_routers = 0
    stats: moe_routing.RoutingStats | None = None


def write_plugin_dist(directory: str | Path) -> Path:
    """A minimal installed-distribution record whose entry point is ``register`` below."""
    dist = Path(directory) / f"{DIST_NAME}-0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST_NAME}\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\n{DIST_NAME} = bench.vllm_routing_plugin:register\n"
    )
    return dist


def register() -> None:
    """vLLM calls this in each of its processes (maybe several times)."""
    if _State.installed:
        return
    _State.installed = True
    _hook_dummy_loader()
    _hook_router()
    _add_worker_method()


def _seed() -> tuple[int | None, float | None]:
    seed = os.environ.get(moe_routing.ENV_SEED)
    std = os.environ.get(moe_routing.ENV_STD)
    return (int(seed) if seed else None), (float(std) if std else None)


def _gates(model) -> list:
    """The routers' weights [E, H], by layer number."""
    found = []
    for name, param in model.named_parameters():
        m = _GATE.search(name)
        if m and param.dim() == 2:
            found.append((int(m.group(1)), param))
    return [p for _, p in sorted(found, key=lambda item: item[0])]


def _hook_dummy_loader() -> None:
    try:
        from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader
    except ImportError as exc:
        _State.hooks["routers"] = f"not installed: {exc!r}"
        return
    load_weights = DummyModelLoader.load_weights

    def load_weights_then_routers(self, model, *args, **kwargs):
        result = load_weights(self, model, *args, **kwargs)
        gates = _gates(model)
        _State.num_routers = len(gates)
        seed, std = _seed()
        if seed is not None:
            import torch

            for index, param in enumerate(gates):
                e, h = param.shape
                w = moe_routing.router_weight(index, e, h, seed, std)
                with torch.no_grad():
                    param.copy_(w.to(param.dtype))
            _State.hooks["routers"] = f"{len(gates)} routers re-drawn (seed {seed})"
        return result

    DummyModelLoader.load_weights = load_weights_then_routers
    _State.hooks.setdefault("routers", "installed (no seed: vLLM's own dummy routers)")


def _hook_router() -> None:
    try:
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    except ImportError as exc:
        _State.hooks["stats"] = f"not installed: {exc!r}"
        return
    select_experts = BaseRouter.select_experts

    def select_and_record(self, *args, **kwargs):
        weights, ids = select_experts(self, *args, **kwargs)
        if _State.stats is None:
            spec = os.environ.get(moe_routing.ENV_LAYERS, "auto")
            layers = moe_routing.stats_layers(spec, _State.num_routers or 1)
            _State.stats = moe_routing.RoutingStats(layers, self.global_num_experts, self.top_k)
        _State.stats.record(id(self), ids)
        return weights, ids

    BaseRouter.select_experts = select_and_record
    _State.hooks["stats"] = "BaseRouter.select_experts"


def pagedd_routing(self, op: str) -> dict | None:
    """The worker-side entry of collective_rpc: "reset" or "read" the counters."""
    if op == "reset":
        if _State.stats is not None:
            _State.stats.reset()
        return {"hooks": dict(_State.hooks)}
    if op == "read":
        raw = _State.stats.raw() if _State.stats is not None else None
        return {"hooks": dict(_State.hooks), "num_routers": _State.num_routers, "raw": raw}
    raise ValueError(f"pagedd_routing: unknown op {op!r}")


def _add_worker_method() -> None:
    for module, name in (("vllm.v1.worker.worker_base", "WorkerBase"),
                         ("vllm.v1.worker.gpu_worker", "Worker")):  # fmt: skip
        try:
            cls = getattr(__import__(module, fromlist=[name]), name)
        except (ImportError, AttributeError):
            continue
        cls.pagedd_routing = pagedd_routing
        _State.hooks["rpc"] = f"{module}.{name}.pagedd_routing"
