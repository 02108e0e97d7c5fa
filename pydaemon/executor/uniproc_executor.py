"""UniProcExecutor: one ModelRunner in the engine core's own process (one device, no ranks)."""

from __future__ import annotations

from pydaemon.config.lora import LoRAAdapterConfig
from pydaemon.config.runner import RunnerConfig
from pydaemon.core.sched.scheduler_output import GrammarOutput, SchedulerOutput
from pydaemon.executor.abstract import AsyncOutput, Executor
from pydaemon.lora_request import LoRARequest
from pydaemon.model_loader.model_paths import load_model_config
from pydaemon.models.parallel import check_parallel
from pydaemon.worker.model_runner import ModelRunner


class UniProcExecutor(Executor):
    def __init__(self, config: RunnerConfig) -> None:
        if config.enable_expert_parallel:  # nothing to partition over: say so
            check_parallel(load_model_config(config.model), 1, 1, True)
        # The runner, for tests and benchmarks that look inside (the engine core never does).
        self.driver_runner = ModelRunner(config)
        self.info = self.driver_runner.runner_info()
        self.model_config = self.driver_runner.model_config

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self.driver_runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> AsyncOutput:
        return self.driver_runner.sample_tokens(grammar_output)

    def add_lora(self, lora_request: LoRARequest, adapter: LoRAAdapterConfig) -> None:
        self.driver_runner.add_lora(lora_request, adapter)

    def remove_lora(self, lora_int_id: int) -> None:
        self.driver_runner.remove_lora(lora_int_id)

    def list_loras(self) -> list[int]:
        return self.driver_runner.list_loras()

    def shutdown(self) -> None:
        self.driver_runner.shutdown()  # the KV copies in flight; the disk tier's file
