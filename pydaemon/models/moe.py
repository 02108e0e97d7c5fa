"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE, Qwen3-MoE and gpt-oss.

Each is the Llama-family decoder (pydaemon/models/llama.py: Mixtral's attention is Mistral's,
Qwen2-MoE's has q/k/v biases, Qwen3-MoE's RMSNorms q and k per head, gpt-oss's has biases on
q/k/v/o, attention sinks and alternating 128-token windows; all config-driven) whose MLP is a
sparse MoE block (pydaemon/layers/moe/block.py) on the layers ``config.moe`` marks sparse, a
dense MLP on the others. Mixtral's checkpoint calls the block ``block_sparse_moe``, gpt-oss's
calls the router ``router``: ``checkpoint_module_renames`` tells the loader. gpt-oss's RMSNorms
scale in float32 and round once (GptOssRMSNorm), its experts have biases and the clamped
SwiGLU (layers/moe/activation.py). Expert parallel (``enable_expert_parallel``) partitions the
experts over the tensor-parallel ranks (pydaemon/layers/moe/layer.py); the attention and the
shared expert stay sliced.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydaemon.config.model import ModelConfig
from pydaemon.config.moe import GPT_OSS
from pydaemon.layers.moe import SparseMoeBlock
from pydaemon.layers.rms_norm import RMSNorm
from pydaemon.models.llama import LlamaForCausalLM, check_tensor_parallel

if TYPE_CHECKING:
    from torch import nn

    from pydaemon.quantization.config import Fp8Config


class MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, quant_config: Fp8Config | None = None) -> None:
        if config.moe is None:
            raise ValueError(f"{config.architecture} is not a mixture-of-experts architecture")
        moe = config.moe

        def make_mlp(layer_idx: int) -> nn.Module | None:  # None: the dense MLP
            if not moe.sparse_layers[layer_idx]:
                return None
            return SparseMoeBlock(config.hidden_size, moe, quant_config)

        super().__init__(config, quant_config, make_mlp=make_mlp)
        if config.architecture == "MixtralForCausalLM":
            self.checkpoint_module_renames = {"mlp": "block_sparse_moe"}
        if config.architecture == GPT_OSS:
            self.checkpoint_module_renames = {"gate": "router"}
            for module in self.modules():
                if isinstance(module, RMSNorm):  # (weight * x).to(dtype), one rounding
                    module.round_once = True

    @staticmethod
    def check_tensor_parallel(config: ModelConfig, tp: int) -> None:
        check_tensor_parallel(config, tp)
        moe = config.moe
        assert moe is not None
        for name, value in (
            ("moe_intermediate_size", moe.intermediate_size),
            ("shared_expert_intermediate_size", moe.shared_expert_intermediate_size),
        ):
            if value % tp:
                raise ValueError(
                    f"{name} ({value}) is not divisible by tensor_parallel_size ({tp}): "
                    f"each rank must hold {name} / {tp} columns of every expert"
                )

    @staticmethod
    def check_expert_parallel(config: ModelConfig, tp: int) -> None:
        """Expert parallel over ``tp`` ranks: whole experts per rank, the rest sliced."""
        check_tensor_parallel(config, tp)
        moe = config.moe
        assert moe is not None
        if moe.num_experts % tp:
            raise ValueError(
                f"num_experts ({moe.num_experts}) is not divisible by tensor_parallel_size "
                f"({tp}): expert parallelism gives each rank as many whole experts"
            )
        shared = moe.shared_expert_intermediate_size
        if shared % tp:
            raise ValueError(
                f"shared_expert_intermediate_size ({shared}) is not divisible by "
                f"tensor_parallel_size ({tp})"
            )
