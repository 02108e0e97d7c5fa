"""The adapters of one worker: the loaded adapters' weights in host memory, and ``max_loras``
device slots.

``add_adapter`` (the engine core's ``add_lora``, through the executor) reads this rank's
shard of the adapter once, checks every tensor (shape, dtype, finite values; a truncated or
unreadable file is a ValueError naming it) and keeps it in host memory (pinned on CUDA) until
``remove_adapter``: what was checked is what runs, and nothing is read from disk in a step, so
files replaced or removed after loading change nothing and cannot fail a step.
How many adapters are held is the engine core's to bound (``max_cpu_loras``, an LRU:
pydaemon/engine/loaded_loras.py); it removes an evicted one here and adds it again when a
request names it.

The model runner calls ``set_step`` once per step with each sequence's ``LoRARequest``
(None: the base model): every adapter of the step gets a slot, the least recently used
adapter not in the step gives its slot up, and the per-token slot indices go to the device
(``LoRASlots.token_slots``), where every LoRA layer reads them. The scheduler never puts more
distinct adapters in the running batch than there are slots (``max_loras``), and the engine
core sends no request with an adapter it has not loaded, so a step always fits.

Slot copies and the token indices are issued on the compute stream, after the previous
step's kernels: an adapter replaced in a slot is never read half-written.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from pydaemon.config.lora import LoRAAdapterConfig, LoRAAdapterError
from pydaemon.config.runner import RunnerConfig
from pydaemon.layers.lora.lora_linear import LoRALinear, LoRASlots, wrap_lora_layers
from pydaemon.lora_request import LoRARequest
from pydaemon.model_loader.lora_adapter import load_lora_weights

logger = logging.getLogger(__name__)

# layer -> {PEFT module name: (A, B)} for each wrapper, this rank's slices, in host memory
HostAdapter = dict[LoRALinear, dict[str, tuple[torch.Tensor, torch.Tensor]]]


def make_lora_manager(
    model: nn.Module, config: RunnerConfig, max_num_batched_tokens: int
) -> LoRAManager | None:
    """The runner's LoRA manager (its wrappers put into ``model``), or None without LoRA."""
    if not config.enable_lora:
        return None
    param = next(model.parameters())
    return LoRAManager(
        model,
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
        max_num_tokens=max(max_num_batched_tokens, config.max_num_seqs),
        dtype=param.dtype,
        device=param.device,
    )


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        *,
        max_loras: int,
        max_lora_rank: int,
        max_num_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.device = device
        self.slots = LoRASlots(max_loras, max_lora_rank, max_num_tokens, device)
        self.layers = wrap_lora_layers(model, self.slots, dtype)
        self._wrappers = list(dict.fromkeys(w for w, _ in self.layers.values()))
        self._host: dict[int, HostAdapter] = {}  # lora_int_id -> weights, in load order
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, LRU
        self._free_slots = list(range(max_loras - 1, -1, -1))
        self._has_stale_slots = False  # token_slots holds adapters' slots (else all -1)

    @property
    def active_lora_ids(self) -> list[int]:
        """Adapters in device slots, least recently used first."""
        return list(self._slot_of)

    @property
    def loaded_lora_ids(self) -> list[int]:
        """Adapters held in host memory, in load order."""
        return list(self._host)

    @property
    def host_bytes(self) -> int:
        """Host memory the loaded adapters' weights take."""
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size()
            for adapter in self._host.values()
            for parts in adapter.values()
            for a, b in parts.values()
        )

    def add_adapter(self, lora_request: LoRARequest, config: LoRAAdapterConfig) -> None:
        """Reads this rank's shard of the adapter, checks it and keeps it (idempotent per id).
        ValueError (LoRAAdapterError) naming what is wrong: nothing is kept then."""
        lora_id = lora_request.lora_int_id
        if lora_id in self._host:
            return
        pin = self.device.type == "cuda"
        adapter: HostAdapter = {}
        for (layer, module), (a, b) in load_lora_weights(config, self.dtype).items():
            found = self.layers.get((layer, module))
            if found is None:
                raise LoRAAdapterError(
                    f"LoRA adapter {lora_request.lora_name!r}: the model has no layer {layer} "
                    f"{module}"
                )
            wrapper, part = found
            a, b = wrapper.shard(part, a, b)
            a, b = a.contiguous(), b.contiguous()
            if pin:
                a, b = a.pin_memory(), b.pin_memory()
            adapter.setdefault(wrapper, {})[module] = (a, b)
        self._host[lora_id] = adapter
        logger.info(
            "LoRA adapter %r (id %d) loaded from %s", lora_request.lora_name, lora_id, config.path
        )

    def remove_adapter(self, lora_int_id: int) -> None:
        """Frees the adapter's slot and host memory (no-op if unknown). A step in flight that
        reads the slot is not disturbed: the next adapter's copy into the slot is issued on
        the compute stream, after it."""
        self._host.pop(lora_int_id, None)
        slot = self._slot_of.pop(lora_int_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def set_step(
        self,
        seq_loras: list[LoRARequest | None],  # each scheduled sequence's, in batch order
        query_lens: np.ndarray,  # [num_seqs] int32
    ) -> None:
        needed = {r.lora_int_id: r for r in seq_loras if r is not None}
        if not needed:
            self.slots.num_active_slots = 0  # eager steps skip LoRA
            if self._has_stale_slots:  # a graph replay reads the buffer whatever the step
                self.slots.token_slots.fill_(-1)
                self._has_stale_slots = False
            return
        for request in needed.values():
            self._activate(request, needed)
        seq_slots = np.fromiter(
            (-1 if r is None else self._slot_of[r.lora_int_id] for r in seq_loras),
            dtype=np.int64,
            count=len(seq_loras),
        )
        self.slots.num_active_slots = int(seq_slots.max()) + 1
        token_slots = torch.from_numpy(np.repeat(seq_slots, query_lens))
        if self.device.type == "cuda":
            token_slots = token_slots.pin_memory()
        self.slots.for_tokens(len(token_slots)).copy_(token_slots, non_blocking=True)
        self._has_stale_slots = True

    def _activate(self, request: LoRARequest, needed: dict[int, LoRARequest]) -> None:
        lora_id = request.lora_int_id
        if lora_id in self._slot_of:
            self._slot_of.move_to_end(lora_id)
            return
        adapter = self._host.get(lora_id)
        if adapter is None:  # the engine core sends no request with an adapter not loaded
            raise RuntimeError(f"LoRA adapter {request.lora_name!r} (id {lora_id}) is not loaded")
        if not self._free_slots:
            victim = next((i for i in self._slot_of if i not in needed), None)
            if victim is None:
                raise RuntimeError(
                    f"a step uses more LoRA adapters than max_loras ({self.slots.max_loras})"
                )
            self._free_slots.append(self._slot_of.pop(victim))
        slot = self._free_slots.pop()
        for wrapper in self._wrappers:
            wrapper.set_lora(slot, adapter.get(wrapper, {}))
        self._slot_of[lora_id] = slot
