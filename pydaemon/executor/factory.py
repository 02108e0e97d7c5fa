"""make_executor: the executor an engine configuration asks for."""

from __future__ import annotations

from pydaemon.config.engine import EngineConfig
from pydaemon.executor.abstract import Executor


def make_executor(config: EngineConfig) -> Executor:
    """One process for one rank; spawned processes on this host for tensor parallelism."""
    if config.tensor_parallel_size > 1:
        from pydaemon.executor.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config)
    from pydaemon.executor.uniproc_executor import UniProcExecutor

    return UniProcExecutor(config)
