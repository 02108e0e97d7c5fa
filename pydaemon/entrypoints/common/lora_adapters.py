"""The LoRA adapters a daemon serves, by name: shared by the gRPC and OpenAI front ends.

A name is the front end's handle for one ``LoRARequest``; the adapter itself is loaded and
unloaded through the engine client (``EngineClient.add_lora`` / ``remove_lora``: the engine
core reads and checks it once, every worker keeps the checked weights), off the event loop.
``--lora-modules name=path ...`` loads adapters at start; ``load`` / ``unload`` change the set
at runtime (gRPC LoadAdapter / UnloadAdapter, HTTP /v1/load_lora_adapter and
/v1/unload_lora_adapter). A request names an adapter (the OpenAI ``model`` field, gRPC
``StartRequest.adapter``) and gets its ``LoRARequest``, or ``AdapterNotFound`` (404 /
NOT_FOUND) before the engine sees it. Every load gets a new ``lora_int_id``, so an adapter
loaded again under the same name never shares KV blocks or a device slot with the old one.
Unloading forgets the name at once; requests already running with the adapter finish with
it, and the engine frees its memory after the last one.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from dataclasses import dataclass, field
from typing import Protocol

from pydaemon.lora_request import LoRAAdapterInfo, LoRARequest

MAX_ADAPTER_NAME_LEN = 128
MAX_ADAPTER_PATH_LEN = 1024
# Printable and unambiguous in URLs, JSON, Prometheus labels and logs: letters, digits and
# ``. _ - / : @ +``, starting with a letter or digit (``org/name-v2`` works; no whitespace,
# control characters, quotes or ``<|...|>`` special-token text).
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-/:@+]*")


class AdapterNotFound(LookupError):
    def __init__(self, name: str) -> None:
        super().__init__(f"LoRA adapter {name!r} is not loaded")
        self.name = name


class LoRAControl(Protocol):
    """The engine client's LoRA calls (pydaemon/engine/engine_client.py)."""

    async def add_lora(self, lora_request: LoRARequest) -> LoRAAdapterInfo: ...
    async def remove_lora(self, lora_int_id: int) -> bool: ...


@dataclass
class LoRAOptions:
    """The daemon's LoRA settings, as its front ends need them."""

    lora_modules: dict[str, str] = field(default_factory=dict)  # name -> path, at start
    is_enabled: bool = False


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
        check_adapter_name(name)
        modules[name] = path
    return modules


def check_adapter_name(name: str) -> None:
    """ValueError (without echoing a bad name's characters) unless ``name`` is usable."""
    if not isinstance(name, str) or not name or len(name) > MAX_ADAPTER_NAME_LEN:
        raise ValueError(f"adapter name must be 1 to {MAX_ADAPTER_NAME_LEN} characters")
    if not _NAME.fullmatch(name) or ".." in name or "//" in name:
        raise ValueError(
            "adapter name may hold letters, digits and . _ - / : @ + only, start with a "
            "letter or digit, and contain no '..' or '//'"
        )


def check_adapter_path(path: str) -> None:
    if not isinstance(path, str) or not path or len(path) > MAX_ADAPTER_PATH_LEN:
        raise ValueError(f"adapter path must be 1 to {MAX_ADAPTER_PATH_LEN} characters")
    if "\x00" in path:
        raise ValueError("adapter path contains a NUL character")


class LoRAAdapters:
    def __init__(self, base_model_name: str, engine: LoRAControl | None, is_enabled: bool) -> None:
        self.base_model_name = base_model_name
        self.engine = engine
        self.is_enabled = is_enabled
        self._adapters: dict[str, LoRAAdapterInfo] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()  # loads and unloads one at a time: names stay consistent

    @classmethod
    async def start(
        cls, base_model_name: str, engine: LoRAControl, options: LoRAOptions
    ) -> LoRAAdapters:
        """The registry with ``options.lora_modules`` loaded (ValueError naming a bad one)."""
        adapters = cls(base_model_name, engine, options.is_enabled)
        for name, path in options.lora_modules.items():
            try:
                await adapters.load(name, path)
            except ValueError as e:
                raise ValueError(f"--lora-modules {name}={path}: {e}") from None
        return adapters

    async def load(self, name: str, path: str) -> LoRAAdapterInfo:
        """Loads adapter ``name`` from the PEFT directory ``path`` on the engine. ValueError
        when LoRA is off, the name is taken or bad, or the adapter cannot be served."""
        if not self.is_enabled:
            raise ValueError("LoRA adapters are not enabled: start the daemon with --enable-lora")
        if self.engine is None:
            raise ValueError("the server is shutting down")
        check_adapter_name(name)
        check_adapter_path(path)
        if name == self.base_model_name:
            raise ValueError(f"adapter name {name!r} is the base model's name")
        async with self._lock:
            if name in self._adapters:
                raise ValueError(f"LoRA adapter {name!r} is already loaded")
            info = await self.engine.add_lora(LoRARequest(name, next(self._ids), str(path)))
            self._adapters[name] = info
        return info

    async def unload(self, name: str) -> None:
        async with self._lock:
            info = self._adapters.pop(name, None)
            if info is None:
                raise AdapterNotFound(name)
            await self.engine.remove_lora(info.lora_int_id)

    def close(self) -> None:
        """Lets go of the engine client (the daemon drained)."""
        self.engine = None

    def get(self, name: str) -> LoRARequest:
        info = self.served(name)
        return LoRARequest(info.lora_name, info.lora_int_id, info.lora_path)

    def served(self, name: str) -> LoRAAdapterInfo:
        served = self._adapters.get(name)
        if served is None:
            raise AdapterNotFound(name)
        return served

    def list(self) -> list[LoRAAdapterInfo]:
        """In the order they were loaded."""
        return list(self._adapters.values())

    def names_hint(self, limit: int = 8) -> str:
        """ " and the LoRA adapters 'a', 'b'" for an error message; "" when there are none."""
        names = [repr(name) for name in list(self._adapters)[:limit]]
        if not names:
            return ""
        more = ", ..." if len(self._adapters) > limit else ""
        return f" and the LoRA adapters {', '.join(names)}{more}"
