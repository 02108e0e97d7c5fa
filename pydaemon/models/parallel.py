"""check_parallel: whether a model splits the way an engine configuration asks, with an error
naming what does not divide (before any rank is started)."""

from __future__ import annotations

from pydaemon.config.model import ModelConfig
from pydaemon.models import get_model_class
from pydaemon.models.pipeline import pp_layer_range


def check_parallel(
    config: ModelConfig,
    tensor_parallel_size: int,
    pipeline_parallel_size: int = 1,
    enable_expert_parallel: bool = False,
) -> None:
    """ValueError naming the size that cannot split the model."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    cls = get_model_class(config.architecture)
    if enable_expert_parallel:
        check = getattr(cls, "check_expert_parallel", None)
        if check is None or config.moe is None:
            raise ValueError(
                f"enable_expert_parallel: {config.architecture} is not a mixture-of-experts "
                "model (no experts to partition)"
            )
        if tp < 2:
            raise ValueError(
                "enable_expert_parallel partitions the experts over the tensor-parallel ranks: "
                f"it needs tensor_parallel_size >= 2 (got {tp})"
            )
        check(config, tp)
    else:
        cls.check_tensor_parallel(config, tp)
    if pp > 1:
        if not getattr(cls, "supports_pp", False):
            raise ValueError(
                f"{config.architecture} cannot be split into pipeline stages "
                f"(pipeline_parallel_size {pp}); use pipeline_parallel_size 1"
            )
        pp_layer_range(config.num_hidden_layers, 0, pp)  # raises when too few layers
