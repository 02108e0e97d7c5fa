"""The FP8 KV-cache scales of a model's attention layers: the checkpoint's (kv_cache_fp8.py
reads them), 1.0 where it has none, or, with ``calculate_kv_scales``
(``--calculate-kv-scales``, vLLM's name), measured on the first request's first step:

- When: the first step that prefills a request other than the engine's warm-up request (a
  few copies of one token: no sample of real K/V); the profiling forward and the CUDA-graph
  warm-ups never measure. Each armed layer measures its K and V over the tokens that step
  writes, before its cache write, so no token is ever stored with a placeholder scale; the
  scales stay fixed afterwards (vLLM does the same). A long prompt split by chunked prefill
  is measured on its first chunk; requests batched into that step all count.
- The scale: ``amax|k| / 200`` and ``amax|v| / 100`` (vLLM's K/V_SCALE_CONSTANT): the measured
  values land at 200 and 100, inside e4m3's 448, which leaves 2.2x / 4.5x headroom for later
  requests whose K/V are larger (above that they saturate). It costs nothing in precision:
  e4m3's steps are relative (2^-4) above 2^-6 times the scale.
- The checkpoint's scales win: a layer's K (or V) scale that the checkpoint gives is kept,
  only the missing ones are measured (a checkpoint's scales come from many tokens; one
  prompt is a worse sample).
- Cost: one host-device sync per layer in that one step (the kernels take the scales as host
  floats); nothing on any other step.
- Tensor parallelism: each rank measures its own heads and the amax is all-reduced (max), so
  every rank holds the same scales, those of TP=1.
- CUDA graphs bake the scales in as kernel arguments: the model runner captures the decode
  graphs once the scales are measured (so the first request also waits for the capture).
"""

from __future__ import annotations

import logging

from torch import nn

from pydaemon.core.sched.scheduler_output import WARMUP_REQUEST_ID, SchedulerOutput
from pydaemon.layers.attention import PagedAttention
from pydaemon.quantization.kv_cache_fp8 import kv_scales_from_checkpoint

logger = logging.getLogger(__name__)


class KVScales:
    """Sets the layers' scales at start-up; ``arm_for`` / ``finish`` around the step that
    measures the missing ones."""

    def __init__(
        self,
        model: nn.Module,
        model_dir: str | None,
        calculate: bool,
        layer_range: tuple[int, int, int] | None = None,
    ) -> None:
        """``model_dir``: the checkpoint to read scales from (None: dummy weights, none).
        ``layer_range``: (start, end, num_layers) when the model holds layers [start, end) of
        num_layers only (a pipeline stage)."""
        self.layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
        scales = [(None, None)] * len(self.layers)
        if model_dir is not None:
            start, end, num_layers = layer_range or (0, len(self.layers), len(self.layers))
            scales = kv_scales_from_checkpoint(model_dir, num_layers, default=None)[start:end]
        for layer, (k_scale, v_scale) in zip(self.layers, scales, strict=True):
            layer.k_scale = 1.0 if k_scale is None else k_scale
            layer.v_scale = 1.0 if v_scale is None else v_scale
        # (K, V) per layer: measured on the first step (none without calculate_kv_scales)
        self.to_calculate = [(calculate and k is None, calculate and v is None) for k, v in scales]
        self.is_pending = any(k or v for k, v in self.to_calculate)
        num_given = sum(k is not None or v is not None for k, v in scales)
        logger.info(
            "KV cache in fp8 (e4m3); %d of %d layers have checkpoint scales, %s",
            num_given,
            len(self.layers),
            "the others measured on the first step" if self.is_pending else "the others 1.0",
        )

    def arm_for(self, out: SchedulerOutput) -> bool:
        """-> True when ``out`` is the step that measures: the layers are armed for its
        forward. Every tensor-parallel rank decides alike from the same SchedulerOutput."""
        if not self.is_pending or all(
            seq.request_id == WARMUP_REQUEST_ID for seq in out.scheduled_new_seqs
        ):
            return False
        for layer, flags in zip(self.layers, self.to_calculate, strict=True):
            layer.kv_scales_to_calculate = flags
        return True

    def finish(self) -> None:
        """After the armed step: every layer has measured; logs the scales."""
        unmeasured = [i for i, m in enumerate(self.layers) if any(m.kv_scales_to_calculate)]
        if unmeasured:
            raise RuntimeError(f"calculate_kv_scales: layers {unmeasured} did not run")
        self.is_pending = False
        logger.info(
            "KV cache scales measured (k_scale, v_scale per layer): %s",
            ", ".join(f"({m.k_scale:.4g}, {m.v_scale:.4g})" for m in self.layers),
        )
