"""Controlled MoE routing for dummy-weight benchmarks, the same for pagedd and vLLM.

With dummy weights the router decides how many experts a step reads, and so what a MoE
figure means: a router that sends every token to the same few experts reads a fraction of
the weights (issue 41: vLLM's FP8 Qwen3-30B-A3B TPOT at batch 64 was below the weight floor
of uniform routing). Two pieces, engine-agnostic here, installed by bench/moe_routing_pagedd.py
and bench/vllm_routing_plugin.py:

- **router weights** re-drawn from a seed: the gate of MoE layer ``l`` (in forward order) is
  ``router_weight(l, E, H, seed, std)``, N(0, std^2) from a CPU generator seeded by (seed, l),
  so both engines load bit-identical routers (std: 1 / sqrt(H) by default, logits of order
  one for RMS-normalised inputs). Gaussian rows route random inputs uniformly; whether the
  engine's hidden states are random enough is what the statistics below show;
- **routing statistics**, recorded on the device inside the forward (so CUDA-graph replays
  count too), for a few MoE layers (first, middle, last by default: each recorded layer adds
  ~6 small kernels to a step): per recorded layer the tokens routed to each expert, and per
  step size T the experts each layer call touched, summed. The summary gives the experts
  touched per layer step (against uniform routing's E (1 - (1 - k / E)^T)) and the histogram.
"""

from __future__ import annotations

import statistics

import torch

ENV_SEED = "PAGEDD_BENCH_MOE_ROUTER_SEED"  # int: re-draw the routers (unset: keep the engine's)
ENV_STD = "PAGEDD_BENCH_MOE_ROUTER_STD"  # float, default 1 / sqrt(hidden)
ENV_LAYERS = (
    "PAGEDD_BENCH_ROUTING_STATS_LAYERS"  # "auto" (first, middle, last), "all", "none", "0,7"
)
MAX_TOKENS = 16384  # step sizes above this are counted in its bucket


def add_arguments(parser) -> None:
    """throughput.py's flags (pagedd and vLLM backends alike)."""
    g = parser.add_argument_group("MoE routing (dummy weights; bench/moe_routing.py)")
    g.add_argument("--moe-router-seed", type=int, default=None,
                   help="re-draw every MoE router from this seed, the same draw in each engine")  # fmt: skip
    g.add_argument("--moe-router-std", type=float, default=None,
                   help="the routers' standard deviation (default 1 / sqrt(hidden))")  # fmt: skip
    g.add_argument("--routing-stats", default=None, metavar="LAYERS",
                   help="record experts touched per step and the per-expert histogram for "
                   "these MoE layers: auto (first, middle, last; the default with "
                   "--moe-router-seed), all, none, or e.g. 0,24")  # fmt: skip


def requested(args) -> tuple[int | None, str]:
    """-> (router seed or None, stats layers spec) from throughput.py's flags."""
    seed = getattr(args, "moe_router_seed", None)
    spec = getattr(args, "routing_stats", None)
    return seed, spec if spec is not None else ("auto" if seed is not None else "none")


def settings(args) -> dict:
    seed, spec = requested(args)
    return {"router_seed": seed, "router_std": getattr(args, "moe_router_std", None),
            "stats_layers": spec}  # fmt: skip


def router_weight(
    layer: int, num_experts: int, hidden: int, seed: int, std: float | None = None
) -> torch.Tensor:  # [E, H] float32 on the CPU
    g = torch.Generator().manual_seed(seed * 100_003 + layer)
    return torch.randn(num_experts, hidden, generator=g) * (hidden**-0.5 if std is None else std)


def stats_layers(spec: str, num_layers: int) -> list[int]:
    """The MoE layer ordinals (forward order) to record: "auto" -> first, middle, last."""
    if spec in ("none", ""):
        return []
    if spec == "all":
        return list(range(num_layers))
    if spec == "auto":
        return sorted({0, num_layers // 2, num_layers - 1})
    layers = sorted({int(v) for v in spec.split(",")})
    if layers and not 0 <= layers[0] <= layers[-1] < num_layers:
        raise ValueError(f"routing stats layers {spec!r}: outside [0, {num_layers})")
    return layers


def uniform_experts_touched(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Expected distinct experts of T tokens that each pick k distinct experts uniformly."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.device.type == "meta"


class RoutingStats:
    """Device-side routing counters of some MoE layers; graph-safe (no host read, fixed
    buffers, updated in place: a captured CUDA graph keeps adding on replay).

    ``layer_index(key)`` numbers the MoE layers in the order of their first call (the
    model's forward order, the same in both engines); ``record(key, topk_ids)`` adds one call
    of T tokens for a recorded layer."""

    def __init__(self, layers: list[int], num_experts: int, top_k: int) -> None:
        self.layers = layers
        self.num_experts, self.top_k = num_experts, top_k
        self._ordinal: dict[int, int] = {}
        self.hist: torch.Tensor | None = None  # [len(layers), E] int64: slots per expert
        self.touched: torch.Tensor | None = None  # [MAX_TOKENS + 1] int64: sum of experts hit
        self.calls: torch.Tensor | None = None  # [MAX_TOKENS + 1] int64: layer calls

    def layer_index(self, key: int) -> int:
        return self._ordinal.setdefault(key, len(self._ordinal))

    def record(self, key: int, topk_ids: torch.Tensor) -> None:  # topk_ids: [T, k] int
        if torch.compiler.is_compiling():  # traced (vLLM's torch.compile): not recorded
            return
        ordinal = self.layer_index(key)
        if ordinal not in self.layers or topk_ids.numel() == 0 or _is_fake(topk_ids):
            return
        device = topk_ids.device
        if self.hist is None:  # first (eager) call: the buffers live on the model's device
            self.hist = torch.zeros(len(self.layers), self.num_experts, dtype=torch.int64,
                                    device=device)  # fmt: skip
            self.touched = torch.zeros(MAX_TOKENS + 1, dtype=torch.int64, device=device)
            self.calls = torch.zeros(MAX_TOKENS + 1, dtype=torch.int64, device=device)
        ids = topk_ids.reshape(-1).long()
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=device)
        counts.index_add_(0, ids, torch.ones_like(ids))
        self.hist[self.layers.index(ordinal)] += counts
        t = min(topk_ids.shape[0], MAX_TOKENS)
        self.touched[t] += (counts > 0).sum()
        self.calls[t] += 1

    def reset(self) -> None:
        with torch.inference_mode():  # the buffers may be inference tensors (made in a forward)
            for t in (self.hist, self.touched, self.calls):
                if t is not None:
                    t.zero_()  # in place: captured graphs keep these buffers

    def raw(self) -> dict:
        """Plain lists (one host read), for crossing a process boundary."""
        if self.hist is None:
            return {"layers": self.layers, "num_experts": self.num_experts,
                    "top_k": self.top_k, "hist": None, "by_tokens": {}}  # fmt: skip
        calls = self.calls.cpu()
        touched = self.touched.cpu()
        by_tokens = {
            int(t): [int(touched[t]), int(calls[t])] for t in calls.nonzero().flatten().tolist()
        }
        return {"layers": self.layers, "num_experts": self.num_experts, "top_k": self.top_k,
                "hist": self.hist.cpu().tolist(), "by_tokens": by_tokens}  # fmt: skip


def summarize(raw: dict) -> dict:
    """-> experts touched per layer step (overall, and per step size with uniform routing's
    expectation next to it), and the per-expert histogram's spread per recorded layer."""
    e, k = raw["num_experts"], raw["top_k"]
    by_tokens = {int(t): v for t, v in raw["by_tokens"].items()}
    out: dict = {"recorded_layers": raw["layers"], "num_experts": e, "top_k": k}
    if raw["hist"] is None or not by_tokens:
        out["note"] = "no routing recorded (the hook never ran on a real tensor)"
        return out
    steps = {
        t: {
            "layer_calls": calls,
            "experts_touched": touched / calls,
            "uniform_expectation": uniform_experts_touched(e, k, t),
        }
        for t, (touched, calls) in sorted(by_tokens.items())
    }
    total_calls = sum(c for _, c in by_tokens.values())
    out["experts_touched_per_layer_step"] = sum(t for t, _ in by_tokens.values()) / total_calls
    out["by_step_tokens"] = steps
    busiest = max(steps, key=lambda t: steps[t]["layer_calls"])
    out["most_common_step_tokens"] = busiest
    layers = []
    for layer, counts in zip(raw["layers"], raw["hist"], strict=True):
        total = sum(counts)
        mean = total / e
        layers.append(
            {
                "layer": layer,
                "slots": total,
                "max_over_mean": max(counts) / mean if mean else 0.0,
                "min_over_mean": min(counts) / mean if mean else 0.0,
                "cv": statistics.pstdev(counts) / mean if mean else 0.0,
                "experts_never_hit": sum(c == 0 for c in counts),
                "tokens_per_expert": counts,
            }
        )
    out["histogram"] = layers
    return out


def describe(summary: dict) -> str:
    """One line: experts touched at the busiest step size against uniform, the spread."""
    if "by_step_tokens" not in summary:
        return summary.get("note", "no routing statistics")
    t = summary["most_common_step_tokens"]
    step = summary["by_step_tokens"][t]
    spread = ", ".join(
        f"L{h['layer']} max/mean {h['max_over_mean']:.2f} cv {h['cv']:.2f}"
        for h in summary["histogram"]
    )
    return (
        f"T={t}: {step['experts_touched']:.1f} of {summary['num_experts']} experts per layer "
        f"step (uniform {step['uniform_expectation']:.1f}); all steps "
        f"{summary['experts_touched_per_layer_step']:.1f}; {spread}"
    )


class Phases:
    """Routing statistics per phase of a benchmark run (W1, TPOT at batch 1, ...): ``reset``
    before a phase, ``read`` after it (a dict from bench/moe_routing.py's ``RoutingStats.raw``
    or an engine's own wrapping of it), summarized under the phase's name."""

    def __init__(self, reset, read) -> None:
        self._reset, self._read = reset, read
        self.results: dict[str, dict] = {}

    def start(self) -> None:
        self._reset()

    def finish(self, name: str) -> None:
        raw = self._read()
        self.results[name] = summarize(raw) if raw is not None else {"note": "no MoE layer ran"}
