"""UniProcExecutor: one ModelRunner in the engine core's own process (one device, no ranks)."""

from __future__ import annotations

from typing import Any

from pydaemon.config.runner import RunnerConfig
from pydaemon.core.rank_calls import RankCall
from pydaemon.core.sched.scheduler_output import GrammarOutput, SchedulerOutput
from pydaemon.executor.abstract import AsyncOutput, Executor
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

    def control(self, call: RankCall) -> Any:
        return call.run(self.driver_runner)

    def shutdown(self) -> None:
        self.driver_runner.shutdown()  # the KV copies in flight; the disk tier's file
