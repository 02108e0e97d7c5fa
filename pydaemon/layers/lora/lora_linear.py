"""LoRA wrappers over the model's fused linear layers, and the step state they read.

``wrap_lora_layers`` replaces, in each decoder layer, ``self_attn.qkv_proj`` and
``mlp.gate_up_proj`` (column-parallel, several packed projections) and ``self_attn.o_proj``
and ``mlp.down_proj`` (row-parallel) by a ``LoRALinear`` that runs the base layer and adds
the LoRA delta of every token's adapter (``add_lora``, pydaemon/layers/lora/punica.py: fused
CUDA kernels, or the torch path of punica_torch.py).

Each wrapper holds ``max_loras`` device slots of fixed size (plus one zero slot) for every
projection it packs: ``lora_a`` [S + 1, n * R, in] (part j's A in rows [j * R, (j + 1) * R))
and ``lora_b`` [S + 1, R, sum(out_j)] (part j's B.T in the columns [part_starts[j],
part_starts[j + 1]), so that one expand covers every part), R = ``max_lora_rank``. Sizes never
change, so CUDA graphs captured once stay valid when adapters move in and out of slots (the
copies are in place).

Tensor parallel (as vLLM): a column-parallel layer keeps A whole and this rank's rows of
each part's B; a row-parallel layer keeps this rank's input columns of A and B whole, and
adds its partial delta before the all-reduce, which then sums the deltas with the products.

``LoRASlots`` is what the model runner writes each step: ``token_slots`` [max_num_tokens]
int64 on the device (each token's slot, -1 = no adapter), read by every layer as its first
T entries; ``num_active_slots`` (slots are handed out lowest first) lets an eager step use only
the slots below it, and skip the LoRA work when no token has an adapter (0). A captured graph
always covers every slot: its shapes cannot depend on the step. ``grouping`` is the step's
tokens grouped by slot for the segmented paths (punica_triton.py, punica_grouped.py): made
by the first layer of a model forward that takes one and shared by the others (two kernels a
step, not a layer); ``wrap_lora_layers`` drops it at the start of every forward of the
model, so that a forward captured into a CUDA graph makes its own inside the graph.
``shrink_stream`` is the side stream on which captured layers run their shrink beside the
base GEMM (with punica.LORA_OVERLAP_SHRINK): one per model, shared by its layers, whose
branches never overlap one another (each is joined before its layer's expand).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from pydaemon.distributed import parallel_state as ps
from pydaemon.layers.lora.punica import (
    add_lora,
    expand_forked,
    fork_lora_shrink,
    uses_grouped_path,
)
from pydaemon.layers.lora.punica_grouped import Grouping, slot_grouping
from pydaemon.layers.parallel_linear import MergedColumnParallelLinear, RowParallelLinear

# Module name in a decoder layer -> the checkpoint (PEFT target) modules it packs.
ROW_PARALLEL_TARGETS = {"o_proj": "self_attn", "down_proj": "mlp"}
PACKED_TARGETS = {"qkv_proj": "self_attn", "gate_up_proj": "mlp"}


class LoRASlots:
    """The per-step adapter index of every token, shared by all LoRA layers."""

    def __init__(
        self, max_loras: int, max_lora_rank: int, max_num_tokens: int, device: torch.device
    ) -> None:
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.token_slots = torch.full((max_num_tokens,), -1, dtype=torch.int64, device=device)
        # The slot numbers, for the torch path's mask (made here: not a kernel in every layer).
        self.slot_ids = torch.arange(max_loras, dtype=torch.int64, device=device)
        # Eager steps: 1 + the highest slot this step uses (0: no adapter); set by the runner.
        self.num_active_slots = max_loras
        # High priority: the shrink is a branch of the step's critical path, and torch hands
        # out streams round-robin from a pool of 32 per priority, so a default-priority stream
        # can be the very stream a graph is captured on (seen in tests/gpu after ~32 streams):
        # the branch would then serialize. The high-priority pool holds no other stream of ours.
        self.shrink_stream = (
            torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        )
        # ((num_tokens, token_slots' version, capturing), the grouping) of this forward, or None.
        self._grouping: tuple[tuple[int, int, bool], Grouping] | None = None

    def new_forward(self) -> None:
        """A model forward starts: the next layer that needs the grouping makes it anew."""
        self._grouping = None

    def grouping(self, token_slots: torch.Tensor) -> Grouping:
        """punica_grouped.slot_grouping of ``token_slots`` (``for_tokens``' view), made once a
        forward; made again if the token count or the slots' contents changed since (their
        version counter) or a graph capture began or ended: for a layer called outside a
        model forward, as in tests (an eager warm-up's grouping must not enter a graph)."""
        capturing = token_slots.is_cuda and torch.cuda.is_current_stream_capturing()
        key = (token_slots.shape[0], token_slots._version, capturing)
        if self._grouping is None or self._grouping[0] != key:
            self._grouping = (key, slot_grouping(token_slots, self.max_loras + 1))
        return self._grouping[1]

    def for_tokens(self, num_tokens: int) -> torch.Tensor:  # -> [num_tokens] int64
        if num_tokens > self.token_slots.shape[0]:
            raise RuntimeError(
                f"a step of {num_tokens} tokens exceeds the LoRA slot buffer "
                f"({self.token_slots.shape[0]} tokens)"
            )
        return self.token_slots[:num_tokens]


class LoRALinear(nn.Module):
    """A base linear layer plus the LoRA deltas of ``max_loras`` adapter slots."""

    def __init__(
        self,
        base_layer: nn.Module,
        module_names: tuple[str, ...],  # PEFT target modules packed here, in output order
        output_sizes: tuple[int, ...],  # this rank's output rows of each
        slots: LoRASlots,
        dtype: torch.dtype,  # the activations' (the base weight may be FP8)
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.module_names = module_names
        self.output_sizes = output_sizes
        self.is_row_parallel = isinstance(base_layer, RowParallelLinear)
        self.slots = slots
        num_slots, rank = slots.max_loras + 1, slots.max_lora_rank
        # This rank's; a quantized base (FP8, int4) may hold no [out, in] ``weight``.
        self.in_features = base_layer.in_features
        n = len(module_names)
        device = next(base_layer.parameters()).device
        self.lora_a = torch.zeros(num_slots, n * rank, self.in_features, dtype=dtype, device=device)
        # Column offsets of the parts in lora_b and in the output: n + 1 values from 0.
        self.part_starts = tuple(itertools.accumulate(output_sizes, initial=0))
        self.lora_b = torch.zeros(num_slots, rank, self.part_starts[-1], dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, sum(output_sizes)]
        base = self.base_layer
        xa = self._fork_shrink(x)  # before the GEMM: the shrink runs beside it
        if self.is_row_parallel:
            out = base.matmul(x, None)
            self._add_lora(out, x, xa)
            out = ps.all_reduce(out)
            return out if base.bias is None else out + base.bias
        out = base(x)
        self._add_lora(out, x, xa)
        return out

    def _fork_shrink(self, x: torch.Tensor) -> torch.Tensor | None:
        """xa [T, n * R] float32 being computed on the side stream, or None (see
        punica.fork_lora_shrink; only while capturing, where every slot is covered)."""
        # x of another dtype would be converted into a temporary that the side stream reads
        # after this returns; the activations have the adapters' dtype anyway.
        if not _is_capturing(x) or x.dtype != self.lora_a.dtype:
            return None
        token_slots = self.slots.for_tokens(x.shape[0])
        return fork_lora_shrink(x, token_slots, self.lora_a, self.slots.shrink_stream)

    def _add_lora(self, out: torch.Tensor, x: torch.Tensor, xa: torch.Tensor | None) -> None:
        if xa is not None:  # the shrink ran beside the base GEMM: join and expand
            token_slots = self.slots.for_tokens(x.shape[0])
            expand_forked(out, xa, x, token_slots, self.lora_a, self.lora_b, self.part_starts,
                          self.slots.shrink_stream)  # fmt: skip
            return
        num_slots = self.slots.max_loras if _is_capturing(x) else self.slots.num_active_slots
        if num_slots == 0:
            return
        token_slots = self.slots.for_tokens(x.shape[0])
        x = x.to(self.lora_a.dtype)
        grouping = self.slots.grouping(token_slots) if uses_grouped_path(x) else None
        add_lora(out, x, token_slots, self.lora_a, self.lora_b, self.part_starts, num_slots,
                 self.slots.slot_ids, grouping)  # fmt: skip

    # ---- slots ------------------------------------------------------------------------------
    def shard(
        self, part: int, lora_a: torch.Tensor, lora_b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """lora_a: [r, in], lora_b: [out_part, r] as in the checkpoint -> this rank's slices."""
        rank = ps.get_tp_rank()
        if self.is_row_parallel:
            n = self.in_features
            return lora_a[:, rank * n : (rank + 1) * n], lora_b
        n = self.output_sizes[part]
        return lora_a, lora_b[rank * n : (rank + 1) * n]

    def set_lora(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill ``slot`` with an adapter's parts: name -> (A [r, in_local], B [out_local, r]
        already scaled); parts it does not target get zeros."""
        rank = self.slots.max_lora_rank
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for j, name in enumerate(self.module_names):
            if name not in weights:
                continue
            a, b = weights[name]
            r = a.shape[0]
            start, end = self.part_starts[j], self.part_starts[j + 1]
            self.lora_a[slot, j * rank : j * rank + r].copy_(a, non_blocking=True)
            self.lora_b[slot, :r, start:end].copy_(b.T, non_blocking=True)

    def reset_lora(self, slot: int) -> None:
        self.set_lora(slot, {})


def _is_capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def wrap_lora_layers(
    model: nn.Module, slots: LoRASlots, dtype: torch.dtype
) -> dict[tuple[int, str], tuple[LoRALinear, int]]:
    """Replace the targetable linear layers of every decoder layer (``model.model.layers``)
    by LoRA wrappers -> (layer index, PEFT module name) -> (wrapper, part index)."""
    wrapped: dict[tuple[int, str], tuple[LoRALinear, int]] = {}
    # Every forward starts without a slot grouping (a captured one makes its own in the graph).
    model.register_forward_pre_hook(lambda module, args: slots.new_forward())
    for layer_idx, layer in enumerate(model.model.layers):
        for name, owner in {**PACKED_TARGETS, **ROW_PARALLEL_TARGETS}.items():
            parent = getattr(layer, owner, None)
            base = getattr(parent, name, None)
            if base is None:
                continue
            if isinstance(base, MergedColumnParallelLinear):
                names, sizes = base.packed_parts, base.output_sizes
            elif isinstance(base, nn.Linear | RowParallelLinear) and name in ROW_PARALLEL_TARGETS:
                names, sizes = (name,), (base.out_features,)
            else:
                kind = type(base).__name__
                raise TypeError(f"layer {layer_idx} {owner}.{name}: no LoRA wrapper for {kind}")
            wrapper = LoRALinear(base, tuple(names), tuple(sizes), slots, dtype)
            setattr(parent, name, wrapper)
            for part, packed in enumerate(names):
                wrapped[(layer_idx, packed)] = (wrapper, part)
    return wrapped
