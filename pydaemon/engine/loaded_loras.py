"""LoadedLoRAs: the engine core's books of LoRA adapters, the one control path to the workers.

``add`` reads the adapter's config and safetensors header once, here (pydaemon/config/lora.py:
supported options, ranks within ``max_lora_rank``, shapes that fit the model), then every rank
reads and checks its shard of the weights and keeps it (``Executor.add_lora``): a bad adapter
is a ValueError at load, never a failed step. Requests may name only loaded adapters.

``max_cpu_loras`` (None: no limit) bounds how many adapters keep their weights in the workers'
host memory, as vLLM's flag does: an LRU. Loading one more evicts the least recently used
adapter that no live request uses (it stays loaded: listed, and usable by name); a request
naming an evicted adapter reads it again from its path first (a file gone or changed since is
a ValueError for that request, naming the adapter). While every held adapter is in use the
bound is passed, and kept again as requests leave.

``remove`` (unload) takes the adapter out of service at once: new requests naming it are
refused, and ``list`` no longer shows it. Requests already using it finish with it: the
workers free its slot and weights when the last of them has left the engine
(``release_unused``, after every step while an unload is pending).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from pydaemon.config.lora import LoRAAdapterConfig, check_lora_fits_model, read_lora_config
from pydaemon.config.model import ModelConfig
from pydaemon.executor.abstract import Executor
from pydaemon.lora_request import LoRAAdapterInfo, LoRARequest

logger = logging.getLogger(__name__)


@dataclass
class _Loaded:
    info: LoRAAdapterInfo
    config: LoRAAdapterConfig
    is_unloading: bool = False


class LoadedLoRAs:
    def __init__(
        self,
        executor: Executor,
        model_config: ModelConfig,
        max_lora_rank: int,
        is_enabled: bool,
        max_cpu_loras: int | None = None,
    ) -> None:
        self.executor = executor
        self.model_config = model_config
        self.max_lora_rank = max_lora_rank
        self.is_enabled = is_enabled
        self.max_cpu_loras = max_cpu_loras
        self._loaded: dict[int, _Loaded] = {}  # lora_int_id -> adapter, in load order
        self._held: OrderedDict[int, None] = OrderedDict()  # on the workers, LRU first

    @property
    def held_ids(self) -> list[int]:
        """Adapters whose weights the workers hold, least recently used first."""
        return list(self._held)

    def add(self, lora_request: LoRARequest, in_use: Iterable[int] = ()) -> LoRAAdapterInfo:
        """Loads the adapter on every rank (idempotent for the same id, name and path), evicting
        the least recently used unused one past ``max_cpu_loras``. ValueError naming what is
        wrong: LoRA off, the id or name taken, a bad adapter."""
        self._check_enabled(lora_request)
        loaded = self._loaded.get(lora_request.lora_int_id)
        if loaded is not None:
            info = loaded.info
            if (info.lora_name, info.lora_path) != (lora_request.lora_name, lora_request.lora_path):
                raise ValueError(
                    f"LoRA adapter id {lora_request.lora_int_id} is already loaded as "
                    f"{info.lora_name!r}"
                )
            if loaded.is_unloading:
                raise ValueError(f"LoRA adapter {info.lora_name!r} is being unloaded")
            return info
        for other in self._loaded.values():
            if other.info.lora_name == lora_request.lora_name and not other.is_unloading:
                raise ValueError(f"LoRA adapter {lora_request.lora_name!r} is already loaded")
        config = read_lora_config(lora_request.lora_path, self.max_lora_rank)
        check_lora_fits_model(config, self.model_config)
        self._make_room(set(in_use))
        self.executor.add_lora(lora_request, config)
        self._held[lora_request.lora_int_id] = None
        info = LoRAAdapterInfo(
            lora_name=lora_request.lora_name,
            lora_int_id=lora_request.lora_int_id,
            lora_path=lora_request.lora_path,
            rank=config.rank,
            target_modules=config.target_modules,
        )
        self._loaded[lora_request.lora_int_id] = _Loaded(info, config)
        return info

    def remove(self, lora_int_id: int, in_use: Iterable[int]) -> bool:
        """Unloads the adapter (see the module docstring); ``in_use``: the adapter ids of the
        engine's live requests. False if it is not loaded (or already being unloaded)."""
        loaded = self._loaded.get(lora_int_id)
        if loaded is None or loaded.is_unloading:
            return False
        loaded.is_unloading = True
        self.release_unused(in_use)
        return True

    def release_unused(self, in_use: Iterable[int]) -> None:
        """Frees, on every rank, the adapters being unloaded that no live request uses, and
        the least recently used unused ones while more are held than max_cpu_loras."""
        pending = [i for i, loaded in self._loaded.items() if loaded.is_unloading]
        used = set(in_use)
        for lora_int_id in pending:
            if lora_int_id not in used:
                if lora_int_id in self._held:
                    del self._held[lora_int_id]
                    self.executor.remove_lora(lora_int_id)
                info = self._loaded.pop(lora_int_id).info
                logger.info("LoRA adapter %r (id %d) unloaded", info.lora_name, lora_int_id)
        self._make_room(used, extra=0)

    @property
    def needs_release(self) -> bool:
        """An unload waits for its last request, or more adapters are held than allowed."""
        over = self.max_cpu_loras is not None and len(self._held) > self.max_cpu_loras
        return over or any(loaded.is_unloading for loaded in self._loaded.values())

    def list(self) -> list[LoRAAdapterInfo]:
        """The adapters in service, in load order."""
        return [loaded.info for loaded in self._loaded.values() if not loaded.is_unloading]

    def is_loaded(self, lora_request: LoRARequest) -> bool:
        loaded = self._loaded.get(lora_request.lora_int_id)
        return loaded is not None and not loaded.is_unloading

    def check_request(self, lora_request: LoRARequest, in_use: Iterable[int] = ()) -> None:
        """A request may run with this adapter: ValueError naming why not. An adapter evicted
        from the workers' memory (max_cpu_loras) is read again now, before the request is
        queued; this marks it the most recently used."""
        self._check_enabled(lora_request)
        lora_id = lora_request.lora_int_id
        loaded = self._loaded.get(lora_id)
        if loaded is None or loaded.is_unloading:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r} (id {lora_id}) is not loaded"
            )
        if loaded.info.lora_name != lora_request.lora_name:
            raise ValueError(
                f"LoRA adapter id {lora_id} is {loaded.info.lora_name!r}, "
                f"not {lora_request.lora_name!r}"
            )
        if lora_id in self._held:
            self._held.move_to_end(lora_id)
            return
        self._make_room(set(in_use))
        try:
            config = read_lora_config(loaded.info.lora_path, self.max_lora_rank)
            if config != loaded.config:
                raise ValueError("its adapter_config.json or tensors' shapes changed")
            self.executor.add_lora(lora_request, config)
        except (ValueError, OSError) as e:
            raise ValueError(
                f"LoRA adapter {loaded.info.lora_name!r} was evicted from host memory "
                f"(max_cpu_loras {self.max_cpu_loras}) and could not be read again from "
                f"{loaded.info.lora_path}: {e}"
            ) from None
        self._held[lora_id] = None
        logger.info("LoRA adapter %r (id %d) read again", loaded.info.lora_name, lora_id)

    def _make_room(self, in_use: set[int], extra: int = 1) -> None:
        """Evicts the least recently used adapters no live request uses until ``extra`` more
        fit under max_cpu_loras (as many as can go: the ones in use stay)."""
        if self.max_cpu_loras is None:
            return
        for lora_id in list(self._held):
            if len(self._held) + extra <= self.max_cpu_loras:
                return
            if lora_id in in_use:
                continue
            self.executor.remove_lora(lora_id)
            del self._held[lora_id]
            name = self._loaded[lora_id].info.lora_name if lora_id in self._loaded else "?"
            logger.info("LoRA adapter %r (id %d) evicted from host memory", name, lora_id)

    def _check_enabled(self, lora_request: LoRARequest) -> None:
        if not self.is_enabled:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r} was asked for but LoRA is not "
                "enabled (EngineConfig.enable_lora, --enable-lora)"
            )
