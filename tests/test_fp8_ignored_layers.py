"""Layers a pre-quantized checkpoint leaves unquantized (HF fp8 ``modules_to_not_convert``,
compressed-tensors ``ignore``): which modules end up FP8 and which in the model dtype, the
ignored ones computing exactly with their checkpoint weights, an all-ignored FP8 checkpoint
equal to the bf16 one, and the errors (a fused layer with only some parts ignored, an ignored
layer stored in FP8, malformed lists). CPU, ``quantization="fp8_emulated"``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from pydaemon.config.checkpoint_format import parse_quantization_config
from pydaemon.layers.parallel_linear import LinearBase
from pydaemon.model_loader.loader import load_model
from pydaemon.quantization.fp8 import FP8_DTYPE

sys.path.insert(0, str(Path(__file__).parent))
from engine_utils import make_hf_model  # noqa: E402
from fp8_utils import LINEARS, write_bf16_checkpoint, write_fp8_checkpoint  # noqa: E402
from kv_logprobs import next_token_logprobs  # noqa: E402

MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(40, 61))]


@pytest.fixture(scope="module")
def float_model(tmp_path_factory) -> Path:
    """A tiny float32 Llama (2 layers, GQA 4 / 2 heads), saved with save_pretrained."""
    path = tmp_path_factory.mktemp("ignored") / "float"
    make_hf_model(path, num_heads=4, num_kv_heads=2, seed=3)
    return path


def _unquantized_layers(model) -> set[str]:
    """-> names of the linear layers (not the LM head) that hold model-dtype weights."""
    found = set()
    for name, module in model.named_modules():
        if name.endswith("_proj") and isinstance(module, (LinearBase, torch.nn.Linear)):
            if module.weight.dtype != FP8_DTYPE:
                assert module.weight.dtype == torch.bfloat16, name
                assert "weight_scale" not in module._parameters, name
                found.add(name)
            else:
                assert module.weight_scale.dtype == torch.float32, name
    return found


def _modules(*names: str) -> tuple[str, ...]:
    return tuple(f"model.layers.{name}" for name in names)


def _check_ignored_layers_compute_in_bf16(model, ckpt_dir: Path, layers: set[str]) -> None:
    """The ignored layers hold the checkpoint's bf16 tensors (q/k/v and gate/up stacked) and
    compute plain bf16 linears with them during a prefill and decodes."""
    tensors = {}
    for path in ckpt_dir.glob("*.safetensors"):
        tensors.update(load_file(str(path)))
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    calls = []

    def check(module, args, out):
        assert torch.equal(out, F.linear(args[0], module.weight))
        calls.append(module)

    hooks = []
    for name in layers:
        parent, _, leaf = name.rpartition(".")
        parts = fused.get(leaf, (leaf,))
        expected = torch.cat([tensors[f"{parent}.{part}.weight"] for part in parts])
        module = model.get_submodule(name)
        assert torch.equal(module.weight, expected), name
        hooks.append(module.register_forward_hook(check))
    try:
        next_token_logprobs(model, torch.bfloat16, PROMPTS, num_steps=3)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(calls) == 4 * len(layers)  # a prefill and 3 decodes


def test_hf_fp8_modules_to_not_convert(float_model, tmp_path):
    """An exact name, a prefix (every linear of layer 1's attention) and the LM head."""
    ignore = ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.self_attn"]
    unquantized = _modules(
        "0.mlp.down_proj", *(f"1.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    )
    ckpt = tmp_path / "hf"
    write_fp8_checkpoint(float_model, ckpt, "hf-block", (32, 48), unquantized, ignore)
    model, config = load_model(ckpt, quantization="fp8_emulated")
    assert config.quantization.ignored_layers == tuple(ignore)
    expected = set(_modules("0.mlp.down_proj", "1.self_attn.qkv_proj", "1.self_attn.o_proj"))
    assert _unquantized_layers(model) == expected
    assert model.lm_head.weight.dtype == torch.bfloat16
    _check_ignored_layers_compute_in_bf16(model, ckpt, expected)


def test_compressed_tensors_ignore_with_regex(float_model, tmp_path):
    """A regex (gate and up of every layer: the fused gate_up_proj), an exact name."""
    ignore = ["lm_head", r"re:.*mlp\.(gate|up)_proj$", "model.layers.0.self_attn.o_proj"]
    unquantized = _modules(
        "0.mlp.gate_proj", "0.mlp.up_proj", "1.mlp.gate_proj", "1.mlp.up_proj", "0.self_attn.o_proj"
    )
    ckpt = tmp_path / "ct"
    write_fp8_checkpoint(float_model, ckpt, "ct-channel", unquantized=unquantized, ignore=ignore)
    model, _ = load_model(ckpt, quantization="fp8_emulated")
    expected = set(_modules("0.mlp.gate_up_proj", "1.mlp.gate_up_proj", "0.self_attn.o_proj"))
    assert _unquantized_layers(model) == expected
    _check_ignored_layers_compute_in_bf16(model, ckpt, expected)


def test_everything_ignored_is_the_bf16_model(float_model, tmp_path):
    """An FP8 checkpoint whose list ignores every linear layer: logits bit for bit those of
    the bf16 checkpoint run unquantized."""
    everything = tuple(
        f"model.layers.{i}.{'mlp' if p in MLP_LINEARS else 'self_attn'}.{p}"
        for i in range(2)
        for p in LINEARS
    )
    write_fp8_checkpoint(
        float_model, tmp_path / "ct", "ct-tensor", unquantized=everything, ignore=["re:.*_proj$"]
    )
    write_bf16_checkpoint(float_model, tmp_path / "bf16")
    fp8, _ = load_model(tmp_path / "ct", quantization="fp8_emulated")
    bf16, _ = load_model(tmp_path / "bf16")
    assert len(_unquantized_layers(fp8)) == 2 * 4
    tokens, logp = next_token_logprobs(fp8, torch.bfloat16, PROMPTS, num_steps=4)
    ref_tokens, ref_logp = next_token_logprobs(bf16, torch.bfloat16, PROMPTS, num_steps=4)
    assert torch.equal(tokens, ref_tokens) and torch.equal(logp, ref_logp)
    # without a list, a bf16 linear of an FP8 checkpoint is quantized at load
    some = tmp_path / "ct-no-list"
    write_fp8_checkpoint(float_model, some, "ct-tensor", unquantized=everything[:1], ignore=[])
    quantized, _ = load_model(some, quantization="fp8_emulated")  # bf16 q_proj quantized at load
    assert _unquantized_layers(quantized) == set()


@pytest.mark.parametrize(
    "fmt, ignore, unquantized, message",
    [
        (
            "ct-channel",
            ["model.layers.0.self_attn.q_proj"],
            _modules("0.self_attn.q_proj"),
            r"quantization_config.ignore leaves model.layers.0.self_attn.q_proj unquantized but "
            r"not model.layers.0.self_attn.k_proj, model.layers.0.self_attn.v_proj: .* "
            r"\(model.layers.0.self_attn.qkv_proj\)",
        ),
        (
            "hf-block",
            ["gate_proj"],  # a suffix: every layer's gate_proj, but not up_proj
            _modules("0.mlp.gate_proj", "1.mlp.gate_proj"),
            r"modules_to_not_convert leaves model.layers.0.mlp.gate_proj unquantized but not "
            r"model.layers.0.mlp.up_proj: .* \(model.layers.0.mlp.gate_up_proj\)",
        ),
    ],
)
def test_fused_layer_with_some_parts_ignored_is_an_error(
    float_model, tmp_path, fmt, ignore, unquantized, message
):
    write_fp8_checkpoint(float_model, tmp_path / "c", fmt, unquantized=unquantized, ignore=ignore)
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path / "c", quantization="fp8_emulated")


def test_ignored_layer_stored_in_fp8_is_an_error(float_model, tmp_path):
    ignore = ["model.layers.1.mlp.down_proj"]
    write_fp8_checkpoint(float_model, tmp_path / "c", "ct-channel", ignore=ignore)  # all FP8
    with pytest.raises(
        ValueError,
        match=r"tensor 'model.layers.1.mlp.down_proj.weight' in model-00001-of-00002.safetensors "
        r"is torch.float8_e4m3fn, but the model holds it unquantized",
    ):
        load_model(tmp_path / "c", quantization="fp8_emulated")


@pytest.mark.parametrize(
    "entry, name, ignored",
    [
        ("model.layers.0.mlp.down_proj", "model.layers.0.mlp.down_proj", True),
        ("model.layers.1", "model.layers.1.self_attn.q_proj", True),  # a prefix
        ("model.layers.1", "model.layers.10.self_attn.q_proj", False),  # whole components
        ("down_proj", "model.layers.7.mlp.down_proj", True),  # a suffix
        ("mlp.down", "model.layers.0.mlp.down_proj", False),
        ("lm_head", "lm_head", True),
        ("lm_head", "model.layers.0.mlp.up_proj", False),
    ],
)
def test_modules_to_not_convert_matching(entry, name, ignored):
    qc = parse_quantization_config({"quant_method": "fp8", "modules_to_not_convert": [entry]})
    assert qc.is_ignored(name) is ignored


@pytest.mark.parametrize(
    "entry, name, ignored",
    [
        ("model.layers.0.mlp.down_proj", "model.layers.0.mlp.down_proj", True),
        ("down_proj", "model.layers.0.mlp.down_proj", False),  # exact names only
        (r"re:.*mlp\.gate$", "model.layers.3.mlp.gate", True),
        (r"re:.*mlp\.gate$", "model.layers.3.mlp.gate_proj", False),
        (r"re:model\.layers\.1\.", "model.layers.1.self_attn.o_proj", True),
        (r"re:layers\.1\.", "model.layers.1.self_attn.o_proj", False),  # re.match: from the start
    ],
)
def test_compressed_tensors_ignore_matching(entry, name, ignored):
    raw = {
        "quant_method": "compressed-tensors",
        "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float"}}},
        "ignore": [entry],
    }
    assert parse_quantization_config(raw).is_ignored(name) is ignored


@pytest.mark.parametrize(
    "raw, message",
    [
        (
            {"quant_method": "fp8", "modules_to_not_convert": "lm_head"},
            "quantization_config.modules_to_not_convert must be a list of module names, got "
            "'lm_head'",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float"}}},
                "ignore": ["lm_head", "re:(mlp"],
            },
            r"quantization_config.ignore entry 're:\(mlp' is not a valid regular expression",
        ),
    ],
)
def test_malformed_ignore_lists(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_quantization_config(raw)


def test_tp2_ignored_layers_are_the_tp1_ones_sliced(float_model, tmp_path):
    """Ignored column- and row-parallel layers under TP=2 (gloo): rank 0 holds TP=1's bf16
    weights sliced, the others stay FP8."""
    from pydaemon.entrypoints.llm import LLM
    from pydaemon.sampling_params import SamplingParams

    ignore = [r"re:model\.layers\.0\.self_attn\.", "model.layers.1.mlp.down_proj"]
    unquantized = _modules(
        *(f"0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")), "1.mlp.down_proj"
    )
    write_fp8_checkpoint(float_model, tmp_path / "ct", "ct-channel", unquantized=unquantized,
                         ignore=ignore)  # fmt: skip
    common = dict(device="cpu", quantization="fp8_emulated", num_kv_blocks=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tp1 = LLM(str(tmp_path / "ct"), **common)
    ref = tp1.generate(prompt_token_ids=PROMPTS, sampling_params=greedy, use_tqdm=False)
    assert len(_unquantized_layers(tp1.engine.runner.model)) == 3
    tp2 = LLM(str(tmp_path / "ct"), tensor_parallel_size=2, **common)
    try:
        got = tp2.generate(prompt_token_ids=PROMPTS, sampling_params=greedy, use_tqdm=False)
        expected = set(_modules("0.self_attn.qkv_proj", "0.self_attn.o_proj", "1.mlp.down_proj"))
        assert _unquantized_layers(tp2.engine.runner.model) == expected  # rank 0's
        one, two = tp1.engine.runner.model.model, tp2.engine.runner.model.model
        q, kv = 64, 32  # rank 0: the first half of q's rows, of k's, of v's
        rows = torch.cat([torch.arange(0, q // 2), q + torch.arange(0, kv // 2),
                          q + kv + torch.arange(0, kv // 2)])  # fmt: skip
        attn1, attn2 = one.layers[0].self_attn, two.layers[0].self_attn
        assert torch.equal(attn2.qkv_proj.weight, attn1.qkv_proj.weight[rows])
        assert torch.equal(attn2.o_proj.weight, attn1.o_proj.weight[:, : q // 2])
        down1, down2 = one.layers[1].mlp.down_proj, two.layers[1].mlp.down_proj
        assert torch.equal(down2.weight, down1.weight[:, :64])
    finally:
        tp2.engine.shutdown()
    # the first token (a prefill): the same; later ones may part at a near-tie (FP8 row-
    # parallel layers quantize each rank's half of the activations with its own scale)
    assert [o.outputs[0].token_ids[0] for o in got] == [o.outputs[0].token_ids[0] for o in ref]


@pytest.mark.parametrize(
    "targets, name, ignored",
    [
        (["Linear"], "model.layers.0.self_attn.o_proj", False),
        ([r"re:.*mlp\..*"], "model.layers.0.mlp.down_proj", False),
        ([r"re:.*mlp\..*"], "model.layers.0.self_attn.o_proj", True),  # not targeted
        (["model.layers.1.mlp.down_proj"], "model.layers.1.mlp.down_proj", False),
        (["model.layers.1.mlp.down_proj"], "model.layers.0.mlp.down_proj", True),
    ],
)
def test_compressed_tensors_layers_not_targeted_stay_unquantized(targets, name, ignored):
    raw = {
        "quant_method": "compressed-tensors",
        "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float"}, "targets": targets}},
    }
    assert parse_quantization_config(raw).is_ignored(name) is ignored


def test_compressed_tensors_targets_only_the_mlp(float_model, tmp_path):
    """config_groups target the MLP linears only: attention's q/k/v/o are stored in bf16 and
    load unquantized, computing exactly in bf16; the MLP loads FP8."""
    attention = tuple(
        f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in LINEARS if p not in MLP_LINEARS
    )
    ckpt = tmp_path / "ct"
    write_fp8_checkpoint(float_model, ckpt, "ct-channel", unquantized=attention)
    config_path = ckpt / "config.json"
    config = json.loads(config_path.read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["targets"] = [r"re:.*mlp\.(gate|up|down)_proj$"]
    config_path.write_text(json.dumps(config))
    model, _ = load_model(ckpt, quantization="fp8_emulated")
    expected = set(_modules("0.self_attn.qkv_proj", "0.self_attn.o_proj"))
    expected |= set(_modules("1.self_attn.qkv_proj", "1.self_attn.o_proj"))
    assert _unquantized_layers(model) == expected
    _check_ignored_layers_compute_in_bf16(model, ckpt, expected)


def test_malformed_targets():
    raw = {
        "quant_method": "compressed-tensors",
        "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float"}, "targets": "Linear"}},
    }
    with pytest.raises(ValueError, match=r"config_groups.g.targets must be a list"):
        parse_quantization_config(raw)
