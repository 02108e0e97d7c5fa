"""The LoRA adapters a daemon serves, by name: shared by the gRPC and OpenAI front ends.

``--lora-modules name=path ...`` registers adapters at start; ``load`` / ``unload`` change the
set at runtime (gRPC LoadAdapter / UnloadAdapter, HTTP /v1/load_lora_adapter and
/v1/unload_lora_adapter). A request names an adapter (the OpenAI ``model`` field, gRPC
``StartRequest.adapter``) and gets its ``LoRARequest``, or ``AdapterNotFound`` (404 /
NOT_FOUND) before the engine sees it. Every load gets a new ``lora_int_id``, so an adapter
loaded again under the same name never shares KV blocks or a device slot with the old one.
Unloading only forgets the name: requests already running keep their LoRARequest (and the
workers their copy of the weights) and finish.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from pydaemon.config.lora import LoRAAdapterConfig, read_lora_config
from pydaemon.lora_request import LoRARequest

MAX_ADAPTER_NAME_LEN = 256


class AdapterNotFound(LookupError):
    def __init__(self, name: str) -> None:
        super().__init__(f"LoRA adapter {name!r} is not loaded")
        self.name = name


@dataclass(frozen=True)
class ServedAdapter:
    request: LoRARequest
    config: LoRAAdapterConfig


@dataclass
class LoRAOptions:
    """The daemon's LoRA settings, as its front ends need them."""

    lora_modules: dict[str, str] = field(default_factory=dict)  # name -> path, at start
    is_enabled: bool = False
    max_lora_rank: int = 16


def parse_lora_modules(specs: list[str] | dict[str, str]) -> dict[str, str]:
    """``["name=path", ...]`` (vLLM's --lora-modules; a TOML table works too) ->
    {name: path}; ValueError if malformed."""
    if isinstance(specs, dict):
        specs = [f"{name}={path}" for name, path in specs.items()]
    modules: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path pairs, got {spec!r}")
        if name in modules:
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules[name] = path
    return modules


class LoRAAdapters:
    @classmethod
    def start(cls, base_model_name: str, options: LoRAOptions) -> LoRAAdapters:
        """The registry with ``options.lora_modules`` loaded (ValueError naming a bad one)."""
        adapters = cls(base_model_name, options.max_lora_rank, options.is_enabled)
        for name, path in options.lora_modules.items():
            try:
                adapters.load(name, path)
            except ValueError as e:
                raise ValueError(f"--lora-modules {name}={path}: {e}") from None
        return adapters

    def __init__(self, base_model_name: str, max_lora_rank: int, is_enabled: bool) -> None:
        self.base_model_name = base_model_name
        self.max_lora_rank = max_lora_rank
        self.is_enabled = is_enabled
        self._adapters: dict[str, ServedAdapter] = {}
        self._ids = itertools.count(1)

    def load(self, name: str, path: str) -> LoRARequest:
        """Registers adapter ``name`` from the PEFT directory ``path``. ValueError when LoRA
        is off, the name is taken or bad, or the adapter cannot be served."""
        if not self.is_enabled:
            raise ValueError("LoRA adapters are not enabled: start the daemon with --enable-lora")
        if not name or len(name) > MAX_ADAPTER_NAME_LEN:
            raise ValueError(f"adapter name must be 1 to {MAX_ADAPTER_NAME_LEN} characters")
        if name == self.base_model_name:
            raise ValueError(f"adapter name {name!r} is the base model's name")
        if name in self._adapters:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        config = read_lora_config(path, self.max_lora_rank)
        request = LoRARequest(name, next(self._ids), str(path))
        self._adapters[name] = ServedAdapter(request, config)
        return request

    def unload(self, name: str) -> None:
        if self._adapters.pop(name, None) is None:
            raise AdapterNotFound(name)

    def get(self, name: str) -> LoRARequest:
        return self.served(name).request

    def served(self, name: str) -> ServedAdapter:
        served = self._adapters.get(name)
        if served is None:
            raise AdapterNotFound(name)
        return served

    def list(self) -> list[ServedAdapter]:
        """In the order they were loaded."""
        return list(self._adapters.values())

    def names_hint(self, limit: int = 8) -> str:
        """ " and the LoRA adapters 'a', 'b'" for an error message; "" when there are none."""
        names = [repr(name) for name in list(self._adapters)[:limit]]
        if not names:
            return ""
        more = ", ..." if len(self._adapters) > limit else ""
        return f" and the LoRA adapters {', '.join(names)}{more}"
