"""Executor: the one interface between the engine core and the workers that run the model.

The engine core (pydaemon/engine/engine_core.py) never touches a worker, a tensor or a rank:
it hands each step down as plain data and gets plain data back, through these calls only:

- ``execute_model(scheduler_output)``: every rank updates its cached state from the
  ``SchedulerOutput``, moves KV blocks and launches the forward pass. Returns at once.
- ``sample_tokens(grammar_output)``: the rank that samples applies the step's grammar bitmask
  (structured outputs: ``GrammarOutput``, computed by the engine core while the forward
  runs; None when no row is constrained), samples and starts the one device-to-host copy.
  Returns an ``AsyncOutput`` whose ``get_output()`` waits for that copy.
- ``add_lora`` / ``remove_lora`` / ``list_loras``: the LoRA control plane, to every rank, as
  typed control calls (pydaemon/core/rank_calls.py) that each backend carries in ``control``.
- ``check_health`` / ``shutdown``.

Implementations: ``UniProcExecutor`` (one ModelRunner in this process),
``MultiprocExecutor`` (the ``mp`` backend: TP x PP ranks as spawned processes on this host,
the sampling rank in this process) and ``RayExecutor`` (the ``ray`` backend: every rank a Ray
actor, over several hosts). ``factory.make_executor`` picks one from the configuration.
"""

from __future__ import annotations

import abc
from typing import Any, Protocol

from pydaemon.config.lora import LoRAAdapterConfig
from pydaemon.config.model import ModelConfig
from pydaemon.core.model_info import RunnerInfo
from pydaemon.core.rank_calls import RankAddLoRA, RankCall, RankListLoRAs, RankRemoveLoRA
from pydaemon.core.runner_output import ModelRunnerOutput
from pydaemon.core.sched.scheduler_output import GrammarOutput, SchedulerOutput
from pydaemon.lora_request import LoRARequest


class AsyncOutput(Protocol):
    """A step's sampled output on its way to the host."""

    def get_output(self) -> ModelRunnerOutput:
        """Waits for the device-to-host copy (once) and returns the host output."""
        ...


class ExecutorFailed(RuntimeError):
    """A rank failed; the engine cannot run any more steps."""


class Executor(abc.ABC):
    # Set by the constructor, from the rank that samples: sizes the scheduler.
    info: RunnerInfo
    model_config: ModelConfig

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Launches the step on every rank (see the module docstring)."""

    @abc.abstractmethod
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> AsyncOutput:
        """Samples the step launched last; call once after each ``execute_model``."""

    def add_lora(self, lora_request: LoRARequest, adapter: LoRAAdapterConfig) -> None:
        """Every rank reads its shard of the adapter's weights, checks them and keeps them
        (ValueError naming what is wrong; then no rank keeps it)."""
        try:
            self.control(RankAddLoRA(lora_request, adapter))
        except ValueError:
            self.control(RankRemoveLoRA(lora_request.lora_int_id))  # no rank keeps half of it
            raise

    def remove_lora(self, lora_int_id: int) -> None:
        """Every rank frees the adapter's slot and weights (no-op if unknown)."""
        self.control(RankRemoveLoRA(lora_int_id))

    def list_loras(self) -> list[int]:
        """The adapter ids the ranks hold, in load order."""
        return self.control(RankListLoRAs())

    @abc.abstractmethod
    def control(self, call: RankCall) -> Any:
        """Runs ``call`` on every rank's runner, in order with the steps. -> the sampling
        rank's result; ValueError if any rank raised one (the rank lives on)."""

    def check_health(self) -> None:  # noqa: B027 - nothing to check with one process
        """Raises ExecutorFailed once a rank has failed."""

    @property
    def is_failed(self) -> bool:
        return False

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stops the ranks (idempotent)."""
