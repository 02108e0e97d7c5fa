"""Model registry: architecture name (from config.json) -> model class."""

from __future__ import annotations

from torch import nn

from pydaemon.models.gemma import GemmaForCausalLM
from pydaemon.models.llama import LlamaForCausalLM
from pydaemon.models.moe import MoeForCausalLM

_MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MoeForCausalLM,
    "Qwen2MoeForCausalLM": MoeForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
    "GptOssForCausalLM": MoeForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Gemma3ForConditionalGeneration": GemmaForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return _MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r} "
            f"(supported: {', '.join(sorted(_MODEL_REGISTRY))})"
        ) from None


__all__ = ["GemmaForCausalLM", "LlamaForCausalLM", "MoeForCausalLM", "get_model_class"]
