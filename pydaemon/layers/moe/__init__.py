"""Mixture-of-experts layers: routing (router.py), grouping tokens by expert (align.py), the
experts' grouped GEMMs (experts.py, fp8.py), the FusedMoE module (layer.py) and the sparse
block of a decoder layer with its router and optional shared expert (block.py)."""

from pydaemon.layers.moe.block import SparseMoeBlock
from pydaemon.layers.moe.layer import MIXTRAL_EXPERT_NAMES, QWEN_EXPERT_NAMES, FusedMoE

__all__ = ["MIXTRAL_EXPERT_NAMES", "QWEN_EXPERT_NAMES", "FusedMoE", "SparseMoeBlock"]
