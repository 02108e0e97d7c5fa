"""Fused layers on CPU: q/k/v and gate/up packed at load (for every tensor-parallel rank, from
safetensors, torch tensors and dummy weights), and the torch paths of residual-add + RMSNorm
and SiLU-and-multiply that the CUDA kernels replace (tests/gpu/test_layer_kernels.py)."""

from __future__ import annotations

import pytest
import torch
from model_utils import save_hf_model
from safetensors.torch import load_file
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pydaemon.distributed import parallel_state as ps
from pydaemon.layers.activation import SiluAndMul
from pydaemon.layers.parallel_linear import MergedColumnParallelLinear
from pydaemon.layers.rms_norm import RMSNorm
from pydaemon.model_loader.loader import load_model
from pydaemon.model_loader.weight_targets import WeightLoader, weight_targets

RANKS = [(1, 0), (2, 0), (2, 1)]  # (tp, rank)


def _as_rank(monkeypatch, tp: int, rank: int) -> None:
    """Builds models as rank ``rank`` of ``tp`` would (no process group: no forward pass)."""
    monkeypatch.setattr(ps, "get_tp_world_size", lambda: tp)
    monkeypatch.setattr(ps, "get_tp_rank", lambda: rank)


def _rows(t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """This rank's rows of a column-parallel checkpoint tensor."""
    n = t.shape[0] // tp
    return t[rank * n : (rank + 1) * n]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    return {
        "llama-tied": save_hf_model(root, "llama", tie_word_embeddings=True),
        "qwen2-bias": save_hf_model(root, "qwen2"),
        "qwen3-qknorm": save_hf_model(root, "qwen3"),
    }


def _assert_packed(model, ckpt: dict[str, torch.Tensor], tp: int, rank: int) -> None:
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."

        def part(name: str, p: str = p) -> torch.Tensor:
            return _rows(ckpt[p + name], tp, rank)

        attn, mlp = layer.self_attn, layer.mlp
        for kind in ("weight", "bias"):
            packed = getattr(attn.qkv_proj, kind)
            if p + f"self_attn.q_proj.{kind}" not in ckpt:
                assert packed is None
                continue
            qkv = [part(f"self_attn.{n}_proj.{kind}") for n in "qkv"]
            assert torch.equal(packed, torch.cat(qkv)), f"layer {i} qkv {kind}"
        gate_up = torch.cat([part("mlp.gate_proj.weight"), part("mlp.up_proj.weight")])
        assert torch.equal(mlp.gate_up_proj.weight, gate_up), f"layer {i} gate_up"
        # The split in the forward pass cuts the packed rows where the parts meet.
        assert attn.q_size == qkv[0].shape[0] and attn.kv_size == qkv[1].shape[0]
        if attn.q_norm is not None:  # replicated, applied per head after the split
            assert torch.equal(attn.q_norm.weight, ckpt[p + "self_attn.q_norm.weight"])
            assert torch.equal(attn.k_norm.weight, ckpt[p + "self_attn.k_norm.weight"])


@pytest.mark.parametrize("tp,rank", RANKS)
@pytest.mark.parametrize("name", ["llama-tied", "qwen2-bias", "qwen3-qknorm"])
def test_packed_weights_are_each_ranks_checkpoint_slices(hf_dirs, monkeypatch, name, tp, rank):
    ckpt = load_file(hf_dirs[name] / "model.safetensors")
    _as_rank(monkeypatch, tp, rank)
    model, config = load_model(hf_dirs[name])
    _assert_packed(model, ckpt, tp, rank)
    if name == "llama-tied":
        assert model.lm_head is None  # the logits reuse the embedding, as before
        assert torch.equal(
            model.model.embed_tokens.weight, _rows(ckpt["model.embed_tokens.weight"], tp, rank)
        )


@pytest.mark.parametrize("tp,rank", RANKS)
def test_torch_tensors_load_like_safetensors(hf_dirs, monkeypatch, tp, rank):
    """A source of full HF-named torch tensors (e.g. GGUF after its name mapping) gets the
    same packed, sliced parameters through WeightLoader."""
    d = hf_dirs["qwen2-bias"]
    ckpt = load_file(d / "model.safetensors")
    _as_rank(monkeypatch, tp, rank)
    from_files, _ = load_model(d)
    from_tensors, _ = load_model(d, load_format="dummy", seed=9)
    loader = WeightLoader(from_tensors)
    assert not loader.load("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(4), (4,), "t")
    for name, tensor in ckpt.items():
        loader.load(name, tensor, tensor.shape, "tensors")
    loader.check_complete("tensors")
    for (n1, p1), (n2, p2) in zip(
        from_files.named_parameters(), from_tensors.named_parameters(), strict=True
    ):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_loader_errors_name_the_checkpoint_tensor(hf_dirs):
    ckpt = load_file(hf_dirs["qwen2-bias"] / "model.safetensors")
    model, _ = load_model(hf_dirs["qwen2-bias"], load_format="dummy")
    loader = WeightLoader(model)
    bad = torch.zeros(7, 64)
    with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.v_proj.bias'.*\[7, 64\]"):
        loader.load("model.layers.1.self_attn.v_proj.bias", bad, bad.shape, "x.safetensors")
    for name, tensor in ckpt.items():
        if name != "model.layers.1.mlp.up_proj.weight":
            loader.load(name, tensor, tensor.shape, "x.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors in x.safetensors: .*up_proj.weight"):
        loader.check_complete("x.safetensors")


@pytest.mark.parametrize("name", ["llama-tied", "qwen2-bias", "qwen3-qknorm"])
def test_checkpoint_names_in_the_checkpoint_models_order(hf_dirs, name):
    """The loader expects exactly the checkpoint's tensors, in transformers' parameter order
    (the order dummy weights are drawn in, so they are the same as before the packing)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs[name])
    model, _ = load_model(hf_dirs[name], load_format="dummy")
    assert list(weight_targets(model)) == [n for n, _ in hf.named_parameters()]


def test_dummy_packed_weights_do_not_depend_on_tp(hf_dirs, monkeypatch):
    d = hf_dirs["qwen2-bias"]
    full, _ = load_model(d, load_format="dummy", seed=5)
    # The TP=1 model's parts, as a checkpoint, then each rank's slices of them.
    ckpt = {}
    for name, target in weight_targets(full).items():
        ckpt[name] = target.dest.clone()
    _assert_packed(full, ckpt, 1, 0)
    for rank in range(2):
        _as_rank(monkeypatch, 2, rank)
        sharded, _ = load_model(d, load_format="dummy", seed=5)
        _assert_packed(sharded, ckpt, 2, rank)


def test_merged_linear_names_the_part_that_does_not_split(monkeypatch):
    _as_rank(monkeypatch, 2, 0)
    with pytest.raises(ValueError, match=r"qkv_proj: k_proj out_features \(3\).*\(2\)"):
        MergedColumnParallelLinear(8, {"q_proj": 6, "k_proj": 3, "v_proj": 3}, False, "qkv_proj")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_torch_path_is_add_then_transformers_norm(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 48, generator=g).to(dtype)
    residual = torch.randn(5, 48, generator=g).to(dtype)
    weight = (1 + 0.3 * torch.randn(48, generator=g)).to(dtype)
    norm, hf = RMSNorm(48, eps=1e-5).to(dtype), LlamaRMSNorm(48, eps=1e-5).to(dtype)
    norm.weight.data.copy_(weight)
    hf.weight.data.copy_(weight)
    x0, r0 = x.clone(), residual.clone()
    out, new_residual = norm(x, residual)
    assert torch.equal(new_residual, x0 + r0)  # the sum in the model dtype, as today
    assert torch.equal(out, hf(x0 + r0))
    assert torch.equal(x, x0) and torch.equal(residual, r0)  # the torch path writes nothing
    assert torch.equal(norm(x), hf(x))
    heads = x.view(5, 3, 16)  # Qwen3's per-head q/k norm: any leading dims
    per_head = RMSNorm(16, eps=1e-5).to(dtype)
    assert torch.equal(per_head(heads), LlamaRMSNorm(16, eps=1e-5).to(dtype)(heads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_and_mul_torch_path_is_transformers_mlp_activation(dtype):
    x = torch.randn(6, 2 * 40, generator=torch.Generator().manual_seed(1)).to(dtype)
    gate, up = x[:, :40], x[:, 40:]
    assert torch.equal(SiluAndMul()(x), ACT2FN["silu"](gate) * up)
