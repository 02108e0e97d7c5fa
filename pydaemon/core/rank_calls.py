"""The control calls the engine core's executor sends every rank between two steps, typed:
each runs the ModelRunner method of its name (the LoRA control plane's last hop; the first
ones are ``core.messages.EngineCall``). The executors carry them as they carry a step (a pipe
to each mp worker, a Ray actor call) and answer with the sampling rank's result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pydaemon.config.lora import LoRAAdapterConfig
from pydaemon.lora_request import LoRARequest


class LoRARunner(Protocol):
    """A rank's ModelRunner, as these calls use it."""

    def add_lora(self, lora_request: LoRARequest, adapter: LoRAAdapterConfig) -> None: ...
    def remove_lora(self, lora_int_id: int) -> None: ...
    def list_loras(self) -> list[int]: ...


@dataclass(frozen=True)
class RankAddLoRA:
    """The rank reads its shard of the adapter's weights, checks it and keeps it (ValueError
    naming what is wrong: then it keeps nothing)."""

    lora_request: LoRARequest
    adapter: LoRAAdapterConfig  # the config the engine core read and checked

    def run(self, runner: LoRARunner) -> None:
        runner.add_lora(self.lora_request, self.adapter)


@dataclass(frozen=True)
class RankRemoveLoRA:
    """The rank frees the adapter's slot and weights (no-op if unknown)."""

    lora_int_id: int

    def run(self, runner: LoRARunner) -> None:
        runner.remove_lora(self.lora_int_id)


@dataclass(frozen=True)
class RankListLoRAs:
    """The adapter ids the rank holds, in load order."""

    def run(self, runner: LoRARunner) -> list[int]:
        return runner.list_loras()


RankCall = RankAddLoRA | RankRemoveLoRA | RankListLoRAs
