"""LoadedLoRAs: the engine core's books of LoRA adapters, the one control path to the workers.

``add`` reads the adapter's config and safetensors header once, here (pydaemon/config/lora.py:
supported options, ranks within ``max_lora_rank``, shapes that fit the model), then every rank
reads and checks its shard of the weights and keeps it (``Executor.add_lora``): a bad adapter
is a ValueError at load, never a failed step. Requests may name only loaded adapters.

``remove`` (unload) takes the adapter out of service at once: new requests naming it are
refused, and ``list`` no longer shows it. Requests already using it finish with it: the
workers free its slot and weights when the last of them has left the engine
(``release_unused``, after every step while an unload is pending).
"""

from __future__ import annotations

import logging
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
        self, executor: Executor, model_config: ModelConfig, max_lora_rank: int, is_enabled: bool
    ) -> None:
        self.executor = executor
        self.model_config = model_config
        self.max_lora_rank = max_lora_rank
        self.is_enabled = is_enabled
        self._loaded: dict[int, _Loaded] = {}  # lora_int_id -> adapter, in load order

    def add(self, lora_request: LoRARequest) -> LoRAAdapterInfo:
        """Loads the adapter on every rank (idempotent for the same id, name and path).
        ValueError naming what is wrong: LoRA off, the id or name taken, a bad adapter."""
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
        self.executor.add_lora(lora_request, config)
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
        """Frees, on every rank, the adapters being unloaded that no live request uses."""
        pending = [i for i, loaded in self._loaded.items() if loaded.is_unloading]
        if not pending:
            return
        used = set(in_use)
        for lora_int_id in pending:
            if lora_int_id not in used:
                self.executor.remove_lora(lora_int_id)
                info = self._loaded.pop(lora_int_id).info
                logger.info("LoRA adapter %r (id %d) unloaded", info.lora_name, lora_int_id)

    @property
    def has_pending_unloads(self) -> bool:
        return any(loaded.is_unloading for loaded in self._loaded.values())

    def list(self) -> list[LoRAAdapterInfo]:
        """The adapters in service, in load order."""
        return [loaded.info for loaded in self._loaded.values() if not loaded.is_unloading]

    def is_loaded(self, lora_request: LoRARequest) -> bool:
        loaded = self._loaded.get(lora_request.lora_int_id)
        return loaded is not None and not loaded.is_unloading

    def check_request(self, lora_request: LoRARequest) -> None:
        """A request may run with this adapter: ValueError naming why not."""
        self._check_enabled(lora_request)
        loaded = self._loaded.get(lora_request.lora_int_id)
        if loaded is None or loaded.is_unloading:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r} (id {lora_request.lora_int_id}) is "
                "not loaded"
            )
        if loaded.info.lora_name != lora_request.lora_name:
            raise ValueError(
                f"LoRA adapter id {lora_request.lora_int_id} is {loaded.info.lora_name!r}, "
                f"not {lora_request.lora_name!r}"
            )

    def _check_enabled(self, lora_request: LoRARequest) -> None:
        if not self.is_enabled:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r} was asked for but LoRA is not "
                "enabled (EngineConfig.enable_lora, --enable-lora)"
            )
