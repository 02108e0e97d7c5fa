"""Controlled MoE routing for the benchmarks (bench/moe_routing.py and its engine hooks) on the
CPU: the seeded router draw, the device-side routing counters (exact counts on known ids),
pagedd's hooks (the routers a dummy load ends with, the statistics of a throughput.py run on a
tiny Qwen3-MoE shape: every routed slot counted once per recorded layer), and the vLLM plugin's
pieces that run without vLLM (its entry point, the router names it re-draws)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch

REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if REPO_ROOT not in sys.path:  # bench/ is imported as a package from the repository root
    sys.path.insert(0, REPO_ROOT)

from bench import moe_routing, throughput, vllm_routing_plugin  # noqa: E402

TINY_QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
    "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8,
    "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "torch_dtype": "float32", "vocab_size": 512,
    "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


@pytest.fixture
def tiny_moe(tmp_path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN3_MOE))
    return tmp_path


def test_router_weight_is_seeded_per_layer():
    a = moe_routing.router_weight(3, 8, 64, seed=7)
    assert a.shape == (8, 64) and a.dtype == torch.float32
    assert torch.equal(a, moe_routing.router_weight(3, 8, 64, seed=7))
    assert not torch.equal(a, moe_routing.router_weight(4, 8, 64, seed=7))
    assert not torch.equal(a, moe_routing.router_weight(3, 8, 64, seed=8))
    assert a.std().item() == pytest.approx(64**-0.5, rel=0.15)
    assert moe_routing.router_weight(0, 8, 64, 1, std=2.0).std().item() == pytest.approx(
        2, rel=0.15
    )


def test_stats_layers_and_uniform_expectation():
    assert moe_routing.stats_layers("auto", 48) == [0, 24, 47]
    assert moe_routing.stats_layers("auto", 1) == [0]
    assert moe_routing.stats_layers("all", 3) == [0, 1, 2]
    assert moe_routing.stats_layers("none", 3) == []
    assert moe_routing.stats_layers("2,0", 3) == [0, 2]
    with pytest.raises(ValueError):
        moe_routing.stats_layers("5", 3)
    assert moe_routing.uniform_experts_touched(128, 8, 1) == pytest.approx(8)
    # top-8 of 128 at 64 tokens: most experts (the weight-floor argument)
    assert 120 < moe_routing.uniform_experts_touched(128, 8, 64) < 128


def test_routing_stats_count_exactly():
    stats = moe_routing.RoutingStats([0, 2], num_experts=4, top_k=2)
    a, b, c = object(), object(), object()  # three layers, in forward order
    stats.record(id(a), torch.tensor([[0, 1], [0, 3]]))
    stats.record(id(b), torch.tensor([[2, 3]]))  # layer 1: not recorded
    stats.record(id(c), torch.tensor([[1, 2]]))
    stats.record(id(a), torch.tensor([[3, 2]]))
    raw = stats.raw()
    assert raw["hist"] == [[2, 1, 1, 2], [0, 1, 1, 0]]
    # T=2: layer 0 touched 3 experts; T=1: layer 2 touched 2, layer 0 touched 2
    assert raw["by_tokens"] == {2: [3, 1], 1: [4, 2]}
    summary = moe_routing.summarize(raw)
    assert summary["experts_touched_per_layer_step"] == pytest.approx(7 / 3)
    assert summary["most_common_step_tokens"] == 1
    assert summary["by_step_tokens"][1]["uniform_expectation"] == pytest.approx(2)
    assert summary["histogram"][0]["max_over_mean"] == pytest.approx(2 / 1.5)
    assert summary["histogram"][1]["experts_never_hit"] == 2
    assert "T=1: 2.0 of 4 experts" in moe_routing.describe(summary)
    stats.reset()
    assert moe_routing.summarize(stats.raw())["note"].startswith("no routing")


def _restore_hooks(monkeypatch):
    """Let monkeypatch put back what moe_routing_pagedd.install replaces."""
    from pydaemon.layers.moe import FusedMoE
    from pydaemon.layers.moe import layer as moe_layer
    from pydaemon.model_loader import loader

    monkeypatch.setattr(loader, "fill_dummy", loader.fill_dummy)
    monkeypatch.setattr(FusedMoE, "forward", FusedMoE.forward)
    monkeypatch.setattr(moe_layer, "select_experts", moe_layer.select_experts)


def test_pagedd_dummy_load_takes_the_seeded_routers(tiny_moe, monkeypatch):
    from bench import moe_routing_pagedd
    from pydaemon.layers.moe import SparseMoeBlock
    from pydaemon.model_loader.loader import load_model

    _restore_hooks(monkeypatch)
    hooks = moe_routing_pagedd.install(seed=11, std=0.5)
    model, _ = load_model(tiny_moe, load_format="dummy")
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == hooks.num_routers == 3
    for index, block in enumerate(blocks):
        want = moe_routing.router_weight(index, 8, 64, seed=11, std=0.5)
        assert torch.equal(block.gate.weight.data, want)


def test_pagedd_throughput_run_reports_routing(tiny_moe, monkeypatch, tmp_path):
    _restore_hooks(monkeypatch)
    out = tmp_path / "out.json"
    argv = ["--backend", "pagedd", "--model", str(tiny_moe), "--load-format", "dummy",
            "--device", "cpu", "--workload", "fixed", "--input-len", "8", "--output-len", "4",
            "--num-requests", "3", "--moe-router-seed", "5", "--routing-stats", "all",
            "--tpot-batch", "1", "--tpot-batch-size", "2", "--tpot-prompt-len", "8",
            "--tpot-output-len", "3", "--no-progress", "--out", str(out)]  # fmt: skip
    assert throughput.main(argv) == 0
    routing = json.loads(out.read_text())["results"][0]["moe_routing"]
    assert routing["router_seed"] == 5 and routing["stats_layers"] == "all"
    w1 = routing["workload"]
    assert w1["recorded_layers"] == [0, 1, 2]
    # 3 prompts of 8 tokens, then 3 decode tokens each: 33 tokens, 2 slots each, per layer
    assert [h["slots"] for h in w1["histogram"]] == [66, 66, 66]
    for step in w1["by_step_tokens"].values():
        assert 1 <= step["experts_touched"] <= 8
    assert w1["by_step_tokens"]["3"]["layer_calls"] == 3 * 3  # 3 decode steps of 3, 3 layers
    # TPOT at batch 2: a warm-up call making 8 tokens, then 3 and 1, each on 2 prompts of 8:
    # 2 * (8 + 7) + 2 * (8 + 2) + 2 * 8 = 66 tokens, 2 slots each, in each of 3 layers
    tpot = routing["tpot_batch2"]
    assert sum(h["slots"] for h in tpot["histogram"]) == 3 * 2 * 66


def test_vllm_plugin_entry_point(tmp_path, monkeypatch):
    vllm_routing_plugin.write_plugin_dist(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    (ep,) = [e for e in eps if e.name == vllm_routing_plugin.DIST_NAME]
    assert ep.value == "bench.vllm_routing_plugin:register"


def test_vllm_plugin_finds_the_routers():
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList()
            for _ in range(12):
                layer = torch.nn.Module()
                layer.mlp = torch.nn.Module()
                layer.mlp.gate = torch.nn.Linear(16, 4, bias=False)  # [E, H]
                layer.mlp.shared_expert_gate = torch.nn.Linear(16, 1, bias=False)
                self.layers.append(layer)

    model = torch.nn.Module()
    model.model = Model()
    gates = vllm_routing_plugin._gates(model)
    assert [g.data_ptr() for g in gates] == [
        layer.mlp.gate.weight.data_ptr() for layer in model.model.layers
    ]  # layers 0..11 in number order (not the names' string order), no shared-expert gates


class _FakeLLM:
    """Just enough of vLLM's offline LLM for throughput_vllm.run_vllm, whose worker side is
    the plugin's own RPC entry (as vLLM's collective_rpc would call it in the engine core)."""

    rpc_fails = False

    def __init__(self, **kwargs) -> None:
        self.llm_engine = types.SimpleNamespace(vllm_config=None)

    def generate(self, prompts, params, use_tqdm=True):
        params = params if isinstance(params, list) else [params] * len(prompts)
        stats = vllm_routing_plugin._State.stats
        if stats is not None:  # the engine's MoE layers route each prompt's tokens
            for p in prompts:
                stats.record(1, torch.zeros(len(p["prompt_token_ids"]), 2, dtype=torch.int64))
        return [
            types.SimpleNamespace(prompt_token_ids=p["prompt_token_ids"],
                                  outputs=[types.SimpleNamespace(token_ids=[7] * sp.max_tokens)])
            for p, sp in zip(prompts, params, strict=True)
        ]  # fmt: skip

    def reset_prefix_cache(self) -> None:
        pass

    def collective_rpc(self, method, args=()):
        if _FakeLLM.rpc_fails:
            raise AttributeError(f"'Worker' object has no attribute {method!r}")
        return [vllm_routing_plugin.pagedd_routing(None, *args)]


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.__version__ = "0.26.0-fake"
    module.LLM = _FakeLLM
    module.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setattr(vllm_routing_plugin._State, "stats",
                        moe_routing.RoutingStats([0], num_experts=4, top_k=2))  # fmt: skip
    monkeypatch.setattr(vllm_routing_plugin._State, "hooks", {"stats": "fake"})
    for name in (moe_routing.ENV_SEED, moe_routing.ENV_LAYERS, "PYTHONPATH"):
        monkeypatch.setenv(name, "")  # recorded: whatever the run sets is undone afterwards
        monkeypatch.delenv(name)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(_FakeLLM, "rpc_fails", False)
    return module


def _vllm_run(tiny_moe: Path, out: Path, *extra: str) -> dict:
    argv = ["--backend", "vllm", "--model", str(tiny_moe), "--load-format", "dummy",
            "--workload", "fixed", "--input-len", "8", "--output-len", "4",
            "--num-requests", "3", "--no-progress", "--out", str(out), *extra]  # fmt: skip
    assert throughput.main(argv) == 0
    return json.loads(out.read_text())["results"][0]


def test_vllm_run_installs_the_plugin_and_reports_routing(fake_vllm, tiny_moe, tmp_path):
    r = _vllm_run(tiny_moe, tmp_path / "out.json", "--moe-router-seed", "9")
    assert os.environ[moe_routing.ENV_SEED] == "9"
    assert os.environ[moe_routing.ENV_LAYERS] == "auto"
    plugin_dir = os.environ["PYTHONPATH"].split(os.pathsep)[0]
    assert (Path(plugin_dir) / f"{vllm_routing_plugin.DIST_NAME}-0.0.dist-info").is_dir()
    routing = r["moe_routing"]
    assert routing["router_seed"] == 9 and routing["hooks"] == {"stats": "fake"}
    # the workload only (the warm-up's routing was reset): 3 prompts of 8 tokens, 2 slots each
    assert routing["workload"]["histogram"][0]["slots"] == 3 * 8 * 2


def test_vllm_run_goes_on_when_the_plugin_is_missing(fake_vllm, tiny_moe, tmp_path):
    _FakeLLM.rpc_fails = True
    r = _vllm_run(tiny_moe, tmp_path / "out.json", "--moe-router-seed", "1")
    assert r["num_output_tokens"] == 12
    assert "did not answer" in r["moe_routing"]["error"]
