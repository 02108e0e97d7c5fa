"""bench/moe_routing.py's controlled routing installed in pagedd (this process only: an engine
whose model runs in other processes, tensor parallelism, does not see it).

- the routers: after ``load_format="dummy"`` filled the weights (``loader.fill_dummy``), the
  gate of each ``SparseMoeBlock`` (in module order, which is the forward order) is replaced
  by ``moe_routing.router_weight(l, ...)``;
- the statistics (dummy loads, which count the MoE layers): ``FusedMoE.forward`` marks its
  layer, and the layer's ``select_experts`` records the ids it returns (eager and captured
  steps alike).

Benchmark-only hooks, as bench/spec_forced.py's: install before the engine is built.
"""

from __future__ import annotations

import torch

from bench import moe_routing


class PagedRouting:
    """The installed hooks; ``stats`` is None until the first MoE layer is built."""

    def __init__(self, seed: int | None, std: float | None, layers_spec: str) -> None:
        self.seed, self.std, self.layers_spec = seed, std, layers_spec
        self.stats: moe_routing.RoutingStats | None = None
        self.num_routers = 0

    def reset(self) -> None:
        if self.stats is not None:
            self.stats.reset()

    def read(self) -> dict | None:
        return None if self.stats is None else self.stats.raw()


def install(seed: int | None, std: float | None = None, layers_spec: str = "auto") -> PagedRouting:
    from pydaemon.layers.moe import FusedMoE, SparseMoeBlock
    from pydaemon.layers.moe import layer as moe_layer
    from pydaemon.model_loader import loader

    routing = PagedRouting(seed, std, layers_spec)
    fill_dummy = loader.fill_dummy

    def fill_dummy_then_routers(model, *args, **kwargs):
        fill_dummy(model, *args, **kwargs)
        blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        routing.num_routers = len(blocks)
        if routing.seed is not None:
            for index, block in enumerate(blocks):
                e, h = block.gate.weight.shape
                w = moe_routing.router_weight(index, e, h, routing.seed, routing.std)
                with torch.no_grad():
                    block.gate.weight.copy_(w)

    loader.fill_dummy = fill_dummy_then_routers
    forward = FusedMoE.forward
    select_experts = moe_layer.select_experts
    current: list[FusedMoE] = []

    def forward_marked(self, x, router_logits):
        if routing.stats is None:  # the layer count from the dummy load (else: layer 0)
            num_layers = routing.num_routers or 1
            layers = moe_routing.stats_layers(routing.layers_spec, num_layers)
            routing.stats = moe_routing.RoutingStats(layers, self.num_experts, self.top_k)
        current[:] = [self]
        return forward(self, x, router_logits)

    def select_and_record(router_logits, top_k, *args, **kwargs):
        weights, ids = select_experts(router_logits, top_k, *args, **kwargs)
        if current and routing.stats is not None:
            routing.stats.record(id(current[0]), ids)
        return weights, ids

    FusedMoE.forward = forward_marked
    moe_layer.select_experts = select_and_record
    return routing
