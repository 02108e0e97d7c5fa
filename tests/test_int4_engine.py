"""4-bit weights through the engine on the CPU: dummy weights in each layout (the unquantized
model's draws, quantized), LoRA adapters on an int4 base, tensor parallelism over gloo (a
GPTQ act-order checkpoint, whose row-parallel shards are dequantized), the logit error of
each format against the unquantized model (docs/models.md), and the errors for what is
refused."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

from pydaemon import LLM, LoRARequest, SamplingParams
from pydaemon.config.checkpoint_format import parse_quantization_config
from pydaemon.layers.moe.int4 import dequantize_expert
from pydaemon.model_loader.loader import load_model
from pydaemon.quantization.int4 import dequantize_int4

sys.path.insert(0, str(Path(__file__).parent))
from lora_utils import save_peft_adapter  # noqa: E402
from model_utils import save_hf_model  # noqa: E402
from moe_utils import save_hf_moe_model  # noqa: E402
from w4_checkpoints import (  # noqa: E402
    logit_error,
    write_dequantized_checkpoint,
    write_int4_checkpoint,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return save_hf_model(tmp_path_factory.mktemp("w4e"), "llama", seed=4)


@pytest.mark.parametrize("method", ["awq", "gptq", "compressed-tensors"])
def test_dummy_int4_is_the_dummy_model_quantized(tmp_path, method):
    """Group 128 (the dummy layouts'): a model whose layers split into groups of 128."""
    src = save_hf_model(tmp_path, "llama", hidden_size=128, intermediate_size=256)
    ref, _ = load_model(src, dtype="float32", load_format="dummy", seed=3)
    model, _ = load_model(src, dtype="float32", load_format="dummy", seed=3, quantization=method)
    layer = model.model.layers[1].mlp.down_proj
    assert layer.qweight.dtype == torch.int32 and layer.in_features == 256
    want = ref.model.layers[1].mlp.down_proj.weight.double()
    got = dequantize_int4(
        layer.qweight, layer.scales, getattr(layer, "qzeros", None), torch.float64
    )
    step = layer.scales.double().repeat_interleave(128, dim=1)
    assert ((got - want).abs() <= step * 0.5 + 1e-7).all()  # round to nearest: half a step
    assert hasattr(layer, "qzeros") == (method == "awq")


def test_dummy_mxfp4_experts_are_the_dummy_model_quantized(tmp_path):
    src = save_hf_moe_model(tmp_path, "qwen3_moe", seed=1, moe_intermediate_size=64)
    ref, _ = load_model(src, dtype="float32", load_format="dummy", seed=2)
    model, _ = load_model(src, dtype="float32", load_format="dummy", seed=2, quantization="mxfp4")
    experts, ref_experts = model.model.layers[0].mlp.experts, ref.model.layers[0].mlp.experts
    w2 = experts.quant_method.weights(experts, "w2")
    for e in range(experts.num_experts):
        want = ref_experts.w2_weight[e].double()
        got = dequantize_expert(w2, e, torch.float64)
        # e2m1 keeps 1 mantissa bit: within a quarter of the value, or of the block's scale
        assert ((got - want).abs() <= 0.25 * want.abs() + 2.0**-7).all()
    assert model.model.layers[0].self_attn.qkv_proj.quant_method is None


def test_lora_on_an_int4_base(llama, tmp_path):
    reference = write_int4_checkpoint(llama, tmp_path / "awq", "awq", group=32)
    write_dequantized_checkpoint(llama, tmp_path / "deq", reference)
    adapter = save_peft_adapter(llama, tmp_path / "adapter", rank=8, seed=5,
                                targets=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])  # fmt: skip
    lora = LoRARequest("a", 1, str(adapter))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 9, 13)]
    choice = [lora, None, lora]
    outs = {}
    for name in ("awq", "deq"):
        llm = LLM(str(tmp_path / name), device="cpu", dtype="float32", num_kv_blocks=64,
                  enable_lora=True, max_lora_rank=8)  # fmt: skip
        try:
            got = llm.generate(
                prompt_token_ids=prompts, sampling_params=GREEDY, lora_request=choice
            )
            outs[name] = [o.outputs[0].token_ids for o in got]
        finally:
            llm.engine.shutdown()
    assert outs["awq"] == outs["deq"]


def test_tp2_gptq_act_order_equals_tp1(llama, tmp_path):
    """q/k/v and gate/up: int4 column slices with the act-order permutation; o_proj and
    down_proj: dequantized per rank (an act-order row shard has no whole groups)."""
    write_int4_checkpoint(llama, tmp_path / "q", "gptq", group=32, sym=True, desc_act=True)
    prompts = [[5, 6, 7, 8, 9], list(range(40, 60)), [3] * 7]
    outs = []
    for tp in (1, 2):
        llm = LLM(str(tmp_path / "q"), device="cpu", dtype="float32", num_kv_blocks=64,
                  tensor_parallel_size=tp)  # fmt: skip
        try:
            got = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
            outs.append([o.outputs[0].token_ids for o in got])
        finally:
            llm.engine.shutdown()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("case", ["awq-dense", "gptq-experts", "mxfp4-experts"])
def test_tp2_int4_and_mxfp4_shards_equal_tp1(tmp_path, case):
    """Whole groups per rank: a dense AWQ Llama (o_proj / down_proj sliced by groups of 32),
    GPTQ experts (the down projection's 32 intermediate columns as two groups of 16) and
    MXFP4 experts (64 intermediate columns: one 32-column block per rank)."""
    if case == "awq-dense":
        src = save_hf_model(tmp_path, "llama", seed=6)
        write_int4_checkpoint(src, tmp_path / "q", "awq", group=32)
    elif case == "gptq-experts":
        src = save_hf_moe_model(tmp_path, "qwen3_moe", seed=6)
        write_int4_checkpoint(src, tmp_path / "q", "gptq", group=16, sym=True)
    else:
        from w4_checkpoints import write_mxfp4_checkpoint

        src = save_hf_moe_model(tmp_path, "qwen3_moe", seed=6, moe_intermediate_size=64)
        write_mxfp4_checkpoint(src, tmp_path / "q")
    prompts = [[5, 6, 7, 8, 9], list(range(40, 60)), [3] * 7]
    outs = []
    for tp in (1, 2):
        llm = LLM(str(tmp_path / "q"), device="cpu", dtype="float32", num_kv_blocks=64,
                  tensor_parallel_size=tp)  # fmt: skip
        try:
            got = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
            outs.append([o.outputs[0].token_ids for o in got])
        finally:
            llm.engine.shutdown()
    assert outs[0] == outs[1]


def test_tp_that_splits_a_group_is_refused(llama, tmp_path):
    write_int4_checkpoint(llama, tmp_path / "q", "awq", group=64)
    # o_proj: 64 input columns, one group; two ranks would hold half a group each.
    with pytest.raises(Exception, match="groups of 64"):
        llm = LLM(str(tmp_path / "q"), device="cpu", dtype="float32", num_kv_blocks=64,
                  tensor_parallel_size=2)  # fmt: skip
        llm.engine.shutdown()


def _all_logits(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    from model_utils import Driver

    model, _ = load_model(model_dir, dtype="float32")
    driver = Driver(model, block_size=16)
    from model_utils import Seq, build_step

    seq = Seq(list(tokens))
    driver.allocator.ensure(seq, len(tokens), 16)
    ids, pos, md = build_step([seq], [len(tokens)], 1, 16, torch.device("cpu"))
    with torch.inference_mode():
        hidden = model(ids, pos, driver.kv_cache, md)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("case", [dict(fmt="awq", group=128), dict(fmt="gptq", group=128, sym=True),
                                  dict(fmt="gptq", group=128, sym=True, desc_act=True),
                                  dict(fmt="ct", group=32, sym=True), dict(fmt="ct", group=None)],
                         ids=["awq-g128", "gptq-g128", "gptq-g128-act", "ct-g32-sym", "ct-channel"])  # fmt: skip
def test_logit_error_against_the_unquantized_model(tmp_path_factory, case):
    """The figures of docs/models.md: a tiny Llama (hidden 256, 2 layers) quantized into each
    format, logits over 64 random tokens against the float32 model's."""
    tmp = tmp_path_factory.mktemp("acc")
    src = save_hf_model(tmp, "llama", seed=7, hidden_size=256, intermediate_size=512,
                        initializer_range=0.05)  # fmt: skip
    write_int4_checkpoint(src, tmp / "q", **case)
    rng = random.Random(1)
    tokens = [rng.randrange(3, 256) for _ in range(64)]
    ref, got = _all_logits(src, tokens), _all_logits(tmp / "q", tokens)
    rms, worst = logit_error(ref, got)
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)  # fmt: skip
    agree = float((ref.argmax(-1) == got.argmax(-1)).float().mean())
    print(
        f"\n{case}: logit error / std(logits): rms {rms:.3f}, max {worst:.3f}; "
        f"KL mean {float(kl.mean()):.4f}, max {float(kl.max()):.4f}; "
        f"argmax agreement {agree:.3f}"
    )  # fmt: skip  (shown with pytest -s)
    # A random model's logits are flat (argmax flips easily); bounds at ~2x the measured.
    assert rms < 0.7 and float(kl.mean()) < 0.1


@pytest.mark.parametrize("qc,message", [
    ({"quant_method": "bitsandbytes"}, "unsupported quant_method 'bitsandbytes'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "only the GEMM layout"),
    ({"quant_method": "awq", "bits": 3, "version": "gemm"}, "only 4-bit AWQ"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "only 4-bit GPTQ"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 96}, "power-of-two group size"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "marlin"),
    ({"quant_method": "gptq", "bits": 4, "dynamic": {r"+:.*down_proj": {"bits": 8}}},
     "override"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float"}}}},
     "only 4-bit integers"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                          "group_size": 128},
                              "input_activations": {"num_bits": 8}}}}, "weight-only"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
      "config_groups": {"g": {}}}, "unsupported compressed-tensors format"),
])  # fmt: skip
def test_refused_formats_are_named(qc, message):
    with pytest.raises(ValueError, match=message):
        parse_quantization_config(qc)


def test_requests_that_do_not_match_the_checkpoint(llama, tmp_path):
    write_int4_checkpoint(llama, tmp_path / "q", "gptq", group=32)
    with pytest.raises(ValueError, match="quant_method 'gptq'"):
        load_model(tmp_path / "q", quantization="awq")
    with pytest.raises(ValueError, match="quant_method 'gptq'"):
        load_model(tmp_path / "q", quantization="fp8_emulated")
    with pytest.raises(ValueError, match="is not quantized"):
        load_model(llama, quantization="awq")
    # An act-order checkpoint without its group index.
    from safetensors.torch import load_file, save_file

    config = json.loads((tmp_path / "q" / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(tmp_path / "q" / "model.safetensors"))
    tensors = {n: t for n, t in tensors.items() if not n.endswith(".g_idx")}
    save_file(tensors, str(tmp_path / "q" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors .*q_proj\.g_idx"):
        load_model(tmp_path / "q")
