"""make_executor: the executor a runner configuration asks for."""

from __future__ import annotations

from pydaemon.config.runner import RunnerConfig
from pydaemon.executor.abstract import Executor


def make_executor(config: RunnerConfig) -> Executor:
    """``distributed_executor_backend`` "ray": Ray actors, at any size (one rank too);
    "mp": spawned processes on this host for several ranks, this process alone for one."""
    if config.distributed_executor_backend == "ray":
        from pydaemon.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    if config.world_size > 1:
        from pydaemon.executor.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config)
    from pydaemon.executor.uniproc_executor import UniProcExecutor

    return UniProcExecutor(config)
