"""Pipeline stages of a decoder: which layers a stage holds, and the placeholder for the
others (vLLM's ``get_pp_indices`` and ``PPMissingLayer``)."""

from __future__ import annotations

from torch import nn


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """-> [start, end): the layers of stage ``pp_rank`` of ``pp_size``. Contiguous, as even
    as they divide; the first stages take one more when they do not (the last stage also
    runs the LM head and the sampler)."""
    if not 1 <= pp_size <= num_layers:
        raise ValueError(
            f"pipeline_parallel_size ({pp_size}) must be between 1 and the model's "
            f"num_hidden_layers ({num_layers}): each stage holds at least one layer"
        )
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


class PPMissingLayer(nn.Module):
    """A layer another pipeline stage holds: no parameters, never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("PPMissingLayer: this layer belongs to another pipeline stage")
