"""Megatron-style tensor-parallel layers, and factories that return the plain torch module
at TP=1 (so the single-GPU model is exactly the unsharded one).

- column-parallel linear: each rank holds ``out_features / tp`` output rows of the weight
  (and of the bias); its output stays sharded (q/k/v by heads, gate/up by columns).
- merged column-parallel linear: several column-parallel projections of one input as one
  GEMM (q/k/v as ``qkv_proj``, gate/up as ``gate_up_proj``); each rank holds its slice of
  every part, the slices concatenated in part order.
- row-parallel linear: each rank holds ``in_features / tp`` input columns; the partial
  products are summed by an all-reduce, then the (replicated) bias is added once.
- vocabulary-parallel embedding / LM head: each rank holds ``ceil(vocab / tp)`` rows (the
  last rank's tail is zero padding); a lookup is masked to the rank's rows and all-reduced;
  logits are gathered along the vocabulary on rank 0.

Every sharded module lists ``tp_shards``: parameter name -> (dim, size in the checkpoint),
which the loader uses to read only this rank's slice (``shard_range``); a merged linear
describes its parts instead (``packed_parts``, ``part_range``; see pydaemon/model_loader/weight_targets.py).

Quantization (vLLM's scheme): a linear layer built with a ``quant_config`` gets its weights
from ``quant_config.linear_method()`` (``create_weights``: e.g. an FP8 ``weight`` and its
``weight_scale``) and computes through it (``apply``); without one it is a plain
``F.linear``. The factories then return the parallel class even at TP=1 (there it is the
unsharded layer). The embedding and the LM head are never quantized; a layer the
checkpoint's ignore list names is made unquantized again (``skip_quantization``, see
pydaemon/model_loader/ignored_layers.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pydaemon.distributed import parallel_state as ps

if TYPE_CHECKING:
    from pydaemon.quantization.config import QuantConfig
    from pydaemon.quantization.fp8 import Fp8LinearMethod
    from pydaemon.quantization.int4_linear import Int4LinearMethod


def _split(size: int, tp: int, what: str) -> int:
    if size % tp != 0:
        raise ValueError(f"{what} ({size}) is not divisible by tensor_parallel_size ({tp})")
    return size // tp


class LinearBase(nn.Module):
    """A linear layer whose weight a quantization method may own (``quant_method``; None:
    unquantized, ``weight`` [out, in] in the activation dtype). ``in_features`` and
    ``out_features`` are this rank's."""

    def __init__(self, quant_config: QuantConfig | None, row_parallel: bool = False) -> None:
        super().__init__()
        self.quant_method: Fp8LinearMethod | Int4LinearMethod | None = (
            None if quant_config is None else quant_config.linear_method(row_parallel)
        )

    def create_weights(self, out_features: int, in_features: int, bias: bool) -> None:
        self.out_features, self.in_features = out_features, in_features
        if self.quant_method is None:
            weight = torch.empty(out_features, in_features)
            self.weight = nn.Parameter(weight, requires_grad=False)
        else:
            self.quant_method.create_weights(self, out_features, in_features)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def skip_quantization(self) -> None:
        """Makes this quantized layer an unquantized one of the same shape (a layer the
        checkpoint leaves unquantized), on the device its parameters are on (meta, before
        the loader materialises them)."""
        assert self.quant_method is not None
        out_features, in_features = self.out_features, self.in_features
        device = self.bias.device if self.bias is not None else next(self.parameters()).device
        for name in self.quant_method.own_dtype_params:
            delattr(self, name)
        if hasattr(self, "weight"):  # a method that keeps a dequantized weight
            delattr(self, "weight")
        self.quant_method = None
        weight = torch.empty(out_features, in_features, device=device)
        self.weight = nn.Parameter(weight, requires_grad=False)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant_method is None:
            return F.linear(x, self.weight, bias)
        return self.quant_method.apply(self, x, bias)


def takes_fp8_input(layer: nn.Module) -> bool:
    """Whether ``layer``'s forward accepts an ``Fp8Activation`` (the op before it quantizes
    its output in its own kernel) as well as a tensor: an FP8-quantized linear layer."""
    return (
        isinstance(layer, LinearBase)
        and layer.quant_method is not None
        and layer.quant_method.takes_fp8_input
    )


class MergedColumnParallelLinear(LinearBase):
    """Column-parallel projections of the same input fused into one GEMM (vLLM's
    MergedColumnParallelLinear / QKVParallelLinear).

    ``parts`` maps each checkpoint module packed here to its full out_features, in order,
    e.g. {"q_proj": 4096, "k_proj": 1024, "v_proj": 1024}. This rank's weight is
    [sum(output_sizes), in_features] with output_sizes[i] = parts[i] / tp: rows
    [rank * output_sizes[i], (rank + 1) * output_sizes[i]) of part i, the parts one after
    the other (likewise the bias). At TP=1 it is the concatenation of the checkpoint tensors.
    The output [T, sum(output_sizes)] splits with ``output_sizes``.
    """

    def __init__(
        self,
        in_features: int,
        parts: dict[str, int],
        bias: bool,
        what: str,
        quant_config: QuantConfig | None = None,
    ) -> None:
        super().__init__(quant_config)
        tp = ps.get_tp_world_size()
        self.packed_parts = tuple(parts)  # names of the checkpoint modules, e.g. "q_proj"
        self.full_sizes = tuple(parts.values())
        self.output_sizes = tuple(
            _split(size, tp, f"{what}: {name} out_features") for name, size in parts.items()
        )
        self.create_weights(sum(self.output_sizes), in_features, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, sum(output_sizes)]
        return self.matmul(x, self.bias)

    def part_range(self, index: int) -> tuple[int, int, int, int]:
        """-> (offset, size, start, full_size): part ``index`` fills rows [offset, offset +
        size) of this rank's weight / bias from rows [start, start + size) of the checkpoint
        tensor, which has full_size rows."""
        size = self.output_sizes[index]
        offset = sum(self.output_sizes[:index])
        return offset, size, ps.get_tp_rank() * size, self.full_sizes[index]


class RowParallelLinear(LinearBase):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        what: str,
        quant_config: QuantConfig | None = None,
    ) -> None:
        super().__init__(quant_config, row_parallel=True)
        tp = ps.get_tp_world_size()
        self.create_weights(out_features, _split(in_features, tp, what), bias)
        self.tp_shards = {"weight": (1, in_features)}  # the bias is replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / tp] -> [T, out]
        out = ps.all_reduce(self.matmul(x, None))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [vocab_start, vocab_start + rows_per_rank) of the table; also the LM head weight."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        tp, rank = ps.get_tp_world_size(), ps.get_tp_rank()
        self.vocab_size = vocab_size
        self.rows_per_rank = math.ceil(vocab_size / tp)
        self.vocab_start = rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)
        self.weight = nn.Parameter(
            torch.empty(self.rows_per_rank, hidden_size), requires_grad=False
        )
        self.tp_shards = {"weight": (0, vocab_size)}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside[:, None], 0.0)
        return ps.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head's vocabulary slice [rows_per_rank, hidden]; used through parallel_logits."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("use parallel_logits(hidden_states, lm_head.weight, vocab_size)")


def parallel_logits(
    hidden_states: torch.Tensor, weight: torch.Tensor, vocab_size: int
) -> torch.Tensor | None:
    """hidden_states: [N, hidden]; weight: [rows_per_rank, hidden] (this rank's vocab slice)
    -> [N, vocab_size] float32 on rank 0, None on the other ranks."""
    full = ps.gather_last_dim(F.linear(hidden_states, weight))
    return None if full is None else full[:, :vocab_size].float()


def row_linear(
    in_features: int,
    out_features: int,
    bias: bool,
    what: str,
    quant_config: QuantConfig | None = None,
) -> nn.Module:
    if ps.get_tp_world_size() == 1 and quant_config is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, what, quant_config)


def vocab_embedding(vocab_size: int, hidden_size: int) -> nn.Module:
    if ps.get_tp_world_size() == 1:
        return nn.Embedding(vocab_size, hidden_size)
    return VocabParallelEmbedding(vocab_size, hidden_size)


def lm_head(hidden_size: int, vocab_size: int) -> nn.Module:
    if ps.get_tp_world_size() == 1:
        return nn.Linear(hidden_size, vocab_size, bias=False)
    return ParallelLMHead(vocab_size, hidden_size)


def shard_range(module: nn.Module, name: str) -> tuple[int, int, int, int] | None:
    """-> (dim, start, stop, full_size) of this rank's slice of parameter ``name`` of
    ``module`` in the checkpoint tensor, or None when the parameter is not sharded.
    ``stop - start`` may be below the local size (vocabulary padding on the last rank)."""
    shards = getattr(module, "tp_shards", None)
    if not shards or name not in shards:
        return None
    dim, full_size = shards[name]
    local = getattr(module, name).shape[dim]
    start = ps.get_tp_rank() * local
    return dim, start, max(start, min(start + local, full_size)), full_size
