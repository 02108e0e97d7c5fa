"""RankWorker: one rank of a model-parallel engine, as the executors drive it remotely.

It joins the process groups (pydaemon/distributed/parallel_state.py), builds the rank's
ModelRunner (its part of the weights and of the KV cache), then runs what the executor sends,
in order: steps (a plain ``SchedulerOutput``), control calls (``RankCall``: LoRA adapters)
and, on the rank that samples, the sampling of each step and the fetch of its output. The
``ray`` backend makes it a Ray actor (pydaemon/executor/ray_executor.py: one method call per
message); the ``mp`` backend's worker processes run it from a pipe loop
(pydaemon/worker/tp_worker.py). Only the executor decides when a rank starts and stops.

A rank that does not sample runs each step whole in ``execute_model``; the rank that samples
(tp_rank 0 of the last pipeline stage) launches it there and samples it in
``sample_tokens``, keeping the output on its way to the host until ``get_output`` fetches it
(oldest first: several steps may be in flight under pipeline parallelism).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import traceback
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from pydaemon.config.model import ModelConfig
from pydaemon.config.runner import RunnerConfig
from pydaemon.core.model_info import RunnerInfo
from pydaemon.core.rank_calls import RankCall
from pydaemon.core.runner_output import ModelRunnerOutput
from pydaemon.core.sched.scheduler_output import GrammarOutput, SchedulerOutput


@dataclass
class WorkerArgs:
    rank: int  # global: pp_rank * tensor_parallel_size + tp_rank
    world_size: int
    backend: str  # "nccl" | "gloo"
    init_method: str  # tcp://HOST:PORT of rank 0's store
    timeout_s: float  # of every collective
    config: RunnerConfig  # every rank's settings (resolved by the engine)
    log_level: int
    local_rank: int | None = None  # CUDA device index on the rank's host (None: rank)
    # CUDA_VISIBLE_DEVICES to set before CUDA starts (Ray: every GPU of the host, so that
    # NCCL sees its peers), None to leave it.
    visible_devices: str | None = None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (this host's address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RankWorker:
    """See the module docstring. Construction is light (a Ray actor is created first, then
    asked where it runs); ``init`` joins the groups and loads the model. A step that raises
    fails the rank (``failure``, reported by ``ping``; the ``mp`` worker's loop exits
    instead)."""

    def __init__(self) -> None:
        self.failure: str | None = None  # the traceback of the step that failed this rank
        self.runner = None
        self.rank = -1
        self._outputs: deque = deque()  # sampled steps' AsyncOutputs, oldest first

    # ---- placement (Ray: before init) ---------------------------------------------------
    def where(self) -> tuple[str, str, int, list[str]]:
        """-> (this rank's Ray node id, the node's address, this process's pid, the GPU ids
        Ray gave it)."""
        import ray  # only Ray actors are asked

        node_id = ray.get_runtime_context().get_node_id()
        gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        return node_id, ray.util.get_node_ip_address(), os.getpid(), gpu_ids

    def free_port(self, host: str) -> int:
        """A free port of this host (``host``: its address), for rank 0's store."""
        return free_port(host)

    # ---- life cycle ---------------------------------------------------------------------
    def init(self, args: WorkerArgs) -> None:
        """Joins the process groups (blocks until every rank has) and builds the runner."""
        if args.visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = args.visible_devices  # before CUDA starts
        logging.basicConfig(
            level=args.log_level,
            format=f"%(asctime)s %(levelname)s rank{args.rank} %(name)s: %(message)s",
        )
        import torch

        from pydaemon import heap_freeze
        from pydaemon.distributed import parallel_state as ps
        from pydaemon.worker.model_runner import ModelRunner

        config = args.config
        if args.backend == "gloo" and args.visible_devices is None:  # CPU ranks share cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
        self.rank = args.rank
        ps.init_model_parallel(
            args.rank,
            args.world_size,
            args.backend,
            args.init_method,
            args.timeout_s,
            tensor_parallel_size=config.tensor_parallel_size,
            pipeline_parallel_size=config.pipeline_parallel_size,
            local_rank=args.local_rank,
            enable_expert_parallel=config.enable_expert_parallel,
        )
        self.runner = ModelRunner(config)
        self.is_sampling_rank = ps.is_sampling_rank()
        heap_freeze.freeze_startup_heap()  # no full collection walks the model in the loop

    def runner_info(self) -> tuple[RunnerInfo, ModelConfig, int]:
        """-> (what the scheduler is sized with, the model's config, KV blocks)."""
        return self.runner.runner_info(), self.runner.model_config, self.runner.num_gpu_blocks

    def shutdown(self) -> None:
        from pydaemon.distributed import parallel_state as ps

        if self.runner is not None:
            self.runner.release_cuda_graphs()  # before the communicator they captured goes
            self.runner.shutdown()  # the KV copies in flight; the disk tier's file
        ps.destroy_model_parallel()

    def ping(self) -> str | None:
        """-> None while healthy; the traceback of the step that failed this rank."""
        return self.failure

    # ---- steps --------------------------------------------------------------------------
    def execute_model(self, out: SchedulerOutput) -> None:
        """Launches the step; a rank that does not sample also finishes its part of it."""
        with self._fatal_errors():
            self.runner.execute_model(out)
            if not self.is_sampling_rank:
                self.runner.sample_tokens(None)  # tp_rank 0 of the last stage samples

    def sample_tokens(self, grammar: GrammarOutput | None) -> None:
        """The sampling rank: samples the step launched last; its output stays on its way
        to the host until ``get_output``."""
        with self._fatal_errors():
            self._outputs.append(self.runner.sample_tokens(grammar))

    def execute_and_sample(self, out: SchedulerOutput, grammar: GrammarOutput | None) -> None:
        """Both halves in one call (a step without constrained rows: one message, not two)."""
        self.execute_model(out)
        self.sample_tokens(grammar)

    def get_output(self) -> ModelRunnerOutput:
        """The oldest sampled step's output on the host (waits for its copy)."""
        with self._fatal_errors():
            return self._outputs.popleft().get_output()

    @contextlib.contextmanager
    def _fatal_errors(self) -> Iterator[None]:
        """A step that raises fails this rank for good: the traceback is kept for ``ping``
        (the executor's monitor reads it there and stops every rank), and every later step
        is refused at once, so that this rank never enters another collective."""
        if self.failure is not None:
            raise RuntimeError(f"rank {self.rank} failed earlier:\n{self.failure}")
        try:
            yield
        except BaseException:
            self.failure = traceback.format_exc()
            logging.getLogger(__name__).error("rank %d failed:\n%s", self.rank, self.failure)
            raise

    # ---- control ------------------------------------------------------------------------
    def control(self, call: RankCall) -> tuple[str, object]:
        """-> ("ok", result) or ("value_error", message): a bad adapter is refused, the rank
        lives on."""
        try:
            return "ok", call.run(self.runner)
        except ValueError as e:
            return "value_error", str(e)
