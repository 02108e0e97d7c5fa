"""MultiprocExecutor: runs the model over TP x PP ranks on this host; this process is the rank
that samples (the ``mp`` backend).

It starts the other ranks as spawned worker processes (one per GPU; gloo on CPUs:
pydaemon/worker/tp_worker.py), joins the process groups as the sampling rank (tp_rank 0 of
the last pipeline stage: rank 0 without pipeline parallelism), builds its ModelRunner (its
shard of the weights and of the KV cache, with the same number of blocks on every rank)
and, for every step, sends the step's plain SchedulerOutput to each worker before running it
itself. Every rank builds its inputs from it in its own runner (no rank is special until
sampling); the collectives inside the model keep the ranks in lockstep, a stage's
intermediate tensors go to the next stage point to point, and the logits are gathered on
this rank, which samples (``sample_tokens`` runs here alone: the grammar bitmask never needs
to travel). Under async scheduling a step's placeholder tokens (the last step's
samples, not yet on the host) are filled on every rank from rank 0's sampled ids, broadcast
device to device (``ModelRunner._share_sampled_ids``). LoRA adapters are loaded and unloaded
on every rank by control calls on the same pipes, in order with the steps.

Why a pipe per worker and not a broadcast collective for the metadata: a worker waits for
the next step for as long as the daemon is idle, which a collective with a timeout cannot
do; a pipe can, and it gives EOF when rank 0 dies, so a worker never outlives the daemon.

Failure: a monitor thread watches the workers' process sentinels. When one dies it records
a clear error, stops the other workers and aborts the NCCL communicator (gloo notices a dead
peer by itself), so a step blocked in a collective returns; every later call raises.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.connection
import pickle
import threading
import time
from typing import Any

import torch

from pydaemon.config.runner import RunnerConfig
from pydaemon.core.rank_calls import RankCall
from pydaemon.core.sched.scheduler_output import GrammarOutput, SchedulerOutput
from pydaemon.distributed import parallel_state as ps
from pydaemon.executor.abstract import AsyncOutput, Executor, ExecutorFailed
from pydaemon.model_loader.model_paths import load_model_config
from pydaemon.models.parallel import check_parallel
from pydaemon.worker.model_runner import ModelRunner, resolve_device
from pydaemon.worker.rank_worker import free_port
from pydaemon.worker.tp_worker import WorkerArgs, worker_main

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 600.0  # generous: loading a large shard happens between collectives
START_TIMEOUT_S = 120.0  # for a spawned worker to import torch and say hello
STOP_TIMEOUT_S = 5.0


class TensorParallelError(ExecutorFailed):
    """A tensor-parallel worker failed; the engine cannot run any more steps."""


class MultiprocExecutor(Executor):
    def __init__(self, config: RunnerConfig) -> None:
        tp, pp, world = (
            config.tensor_parallel_size,
            config.pipeline_parallel_size,
            config.world_size,
        )
        if world < 2:
            raise ValueError(f"MultiprocExecutor needs 2 ranks or more, got TP {tp} x PP {pp}")
        model_config = load_model_config(config.model)
        check_parallel(model_config, tp, pp, config.enable_expert_parallel)
        device = resolve_device(config.device)
        if device.type == "cuda" and world > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size x pipeline_parallel_size ({tp} x {pp}) is larger than "
                f"the number of visible CUDA devices ({torch.cuda.device_count()}); several "
                "hosts need distributed_executor_backend 'ray'"
            )
        backend = "nccl" if device.type == "cuda" else "gloo"
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.world_size = world
        self.driver_rank = (pp - 1) * tp  # tp_rank 0 of the last stage: it samples
        self.failure: str | None = None  # set once a worker failed
        # Rank 0's runner, once built (tests and benchmarks look inside; the engine never does).
        self.driver_runner: ModelRunner | None = None
        self._is_closed = False
        self._lock = threading.Lock()
        self._probe_lock = threading.Lock()
        ctx = torch.multiprocessing.get_context("spawn")
        self.workers: list = []
        self.conns: list[multiprocessing.connection.Connection] = []
        self.worker_ranks = [r for r in range(world) if r != self.driver_rank]
        atexit.register(self.shutdown)
        for rank in self.worker_ranks:
            parent_conn, child_conn = ctx.Pipe()
            args = WorkerArgs(
                rank,
                world,
                backend,
                init_method,
                COLLECTIVE_TIMEOUT_S,
                config,
                logging.getLogger().getEffectiveLevel(),
            )
            proc = ctx.Process(
                target=worker_main, args=(args, child_conn), name=f"pagedd-tp{rank}", daemon=True
            )
            proc.start()
            child_conn.close()  # the worker's end lives in the worker only: EOF when it dies
            self.workers.append(proc)
            self.conns.append(parent_conn)
        try:
            self._wait_for("hello", START_TIMEOUT_S)
            ps.init_model_parallel(
                self.driver_rank,
                world,
                backend,
                init_method,
                COLLECTIVE_TIMEOUT_S,
                tensor_parallel_size=tp,
                pipeline_parallel_size=pp,
                enable_expert_parallel=config.enable_expert_parallel,
            )
            self.driver_runner = ModelRunner(config)
            self.info = self.driver_runner.runner_info()
            self.model_config = self.driver_runner.model_config
            self._wait_for("ready", COLLECTIVE_TIMEOUT_S)
        except BaseException as e:
            failure = None if isinstance(e, TensorParallelError) else self._find_failure()
            self.shutdown()
            if failure is not None:
                raise TensorParallelError(failure) from e
            raise
        self._monitor = threading.Thread(target=self._watch, name="pagedd-tp-monitor", daemon=True)
        self._monitor.start()
        logger.info(
            "model parallel: TP %d x PP %d ranks over %s (workers: pids %s)",
            tp,
            pp,
            backend,
            ", ".join(str(p.pid) for p in self.workers),
        )

    # ---- the step ---------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Every rank launches the step: returns once rank 0 has. A worker never waits for
        its GPU either: it launches its part and reads the next message while this one runs."""
        self._raise_if_failed()
        try:
            self._broadcast(scheduler_output)
            self.driver_runner.execute_model(scheduler_output)
        except Exception as e:
            failure = self._wait_failure()
            raise TensorParallelError(failure or f"tensor-parallel step failed: {e!r}") from e

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> AsyncOutput:
        """Rank 0 samples (the workers took their part of the step in ``execute_model``)."""
        self._raise_if_failed()
        try:
            return self.driver_runner.sample_tokens(grammar_output)
        except Exception as e:
            failure = self._wait_failure()
            raise TensorParallelError(failure or f"tensor-parallel step failed: {e!r}") from e

    @property
    def is_failed(self) -> bool:
        return self.failure is not None

    def _raise_if_failed(self) -> None:
        if self.failure is not None:  # set by the monitor thread; no probing on the hot path
            raise TensorParallelError(self.failure)

    # ---- control calls (LoRA), on every rank ------------------------------------------------
    def list_loras(self) -> list[int]:
        return self.driver_runner.list_loras()  # every rank holds the same: no round trip

    def control(self, call: RankCall) -> Any:
        """Runs ``call`` on every rank's runner, workers first (their replies are awaited
        here, in order with the steps on the same pipes); ValueError if any rank raised it."""
        self._raise_if_failed()
        with self._probe_lock:  # the replies are read here, not by a failure probe
            self._broadcast(call)
            problems = []
            for rank, proc, conn in self._ranked_workers():
                kind, payload = self._reply(rank, proc, conn)
                if kind == "value_error":
                    problems.append(payload)
                elif kind != "ok":
                    self.failure = f"tensor-parallel worker rank {rank} failed:\n{payload}"
                    raise TensorParallelError(self.failure)
        try:
            result = call.run(self.driver_runner)
        except ValueError as e:
            problems.insert(0, str(e))
        if problems:
            raise ValueError(problems[0])
        return result

    def _reply(self, rank: int, proc, conn) -> tuple[str, object]:
        while not conn.poll(0.1):
            if not proc.is_alive():
                self.failure = f"tensor-parallel worker rank {rank} (pid {proc.pid}) died"
                raise TensorParallelError(self.failure)
        try:
            return conn.recv()
        except EOFError:
            self.failure = f"tensor-parallel worker rank {rank} (pid {proc.pid}) died"
            raise TensorParallelError(self.failure) from None

    def _broadcast(
        self, out: SchedulerOutput | RankCall | None, ignore_errors: bool = False
    ) -> None:
        """Sends the step, a control call or None (stop) to every worker; pickled once."""
        data = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            try:
                conn.send_bytes(data)
            except OSError:
                if not ignore_errors:
                    raise

    def _ranked_workers(self) -> list:
        """-> [(rank, process, pipe)] of the worker processes."""
        return list(zip(self.worker_ranks, self.workers, self.conns, strict=True))

    def check_health(self) -> None:
        """Raises TensorParallelError once any worker has failed."""
        if self.failure is None:
            self.failure = self._find_failure()
        if self.failure is not None:
            raise TensorParallelError(self.failure)

    # ---- failures ---------------------------------------------------------------------------
    def _find_failure(self) -> str | None:
        """A description of the first failed worker (its traceback if it sent one), or None."""
        with self._probe_lock:  # the engine thread and the monitor thread both probe
            return self._probe_workers()

    def _probe_workers(self) -> str | None:
        for rank, proc, conn in self._ranked_workers():
            message = None
            try:
                while conn.poll():
                    kind, payload = conn.recv()
                    if kind == "error":
                        message = payload
            except (EOFError, OSError):
                pass
            if message is not None:
                return f"tensor-parallel worker rank {rank} (pid {proc.pid}) failed:\n{message}"
            if not proc.is_alive():
                return (
                    f"tensor-parallel worker rank {rank} (pid {proc.pid}) died "
                    f"(exit code {proc.exitcode})"
                )
        return None

    def _wait_failure(self, timeout_s: float = 2.0) -> str | None:
        """After a failed collective: the worker that caused it (it may take a moment to exit)."""
        deadline = time.monotonic() + timeout_s
        while True:
            failure = self.failure or self._find_failure()
            if failure is not None or time.monotonic() > deadline:
                return failure
            time.sleep(0.05)

    def _wait_for(self, kind: str, timeout_s: float) -> None:
        """Waits for message ``kind`` from every worker; raises when one fails or times out."""
        deadline = time.monotonic() + timeout_s
        for rank, proc, conn in self._ranked_workers():
            while not conn.poll(0.1):
                if not proc.is_alive():
                    raise TensorParallelError(self._died_before(kind, rank, proc))
                if time.monotonic() > deadline:
                    raise TensorParallelError(
                        f"tensor-parallel worker rank {rank} (pid {proc.pid}) sent no {kind!r} "
                        f"within {timeout_s:.0f} s"
                    )
            try:
                got, payload = conn.recv()
            except EOFError:
                proc.join(1.0)
                raise TensorParallelError(self._died_before(kind, rank, proc)) from None
            if got == "error":
                raise TensorParallelError(
                    f"tensor-parallel worker rank {rank} (pid {proc.pid}) failed:\n{payload}"
                )
            if got != kind:
                raise TensorParallelError(f"worker rank {rank} sent {got!r}, expected {kind!r}")

    def _died_before(self, kind: str, rank: int, proc) -> str:
        failure = self._find_failure() or f"tensor-parallel worker rank {rank} died"
        if kind != "hello":
            return failure
        return (
            f"{failure} before it started: a spawned process imports the main module again, "
            'so a script that builds an engine must do so under `if __name__ == "__main__":`'
        )

    def _watch(self) -> None:
        sentinels = [p.sentinel for p in self.workers]
        while not self._is_closed:
            if not multiprocessing.connection.wait(sentinels, timeout=0.5):
                continue
            if self._is_closed:
                return
            self.failure = self._wait_failure(0.5) or "a tensor-parallel worker died"
            logger.error("%s; stopping the other workers", self.failure)
            self._stop_workers(graceful=False)
            ps.abort_model_parallel()
            return

    # ---- shutdown ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stops every worker (idempotent; also registered with atexit)."""
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
        atexit.unregister(self.shutdown)
        self._stop_workers(graceful=True)
        if self.driver_runner is not None:
            self.driver_runner.release_cuda_graphs()  # before the communicator they captured goes
            self.driver_runner.shutdown()  # the KV copies in flight; the disk tier's file
        ps.destroy_model_parallel()

    def _stop_workers(self, graceful: bool) -> None:
        if graceful:
            self._broadcast(None, ignore_errors=True)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for proc in self.workers:
                proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.workers:  # workers ignore SIGTERM: see worker.py
            if proc.is_alive():
                proc.kill()
        for proc in self.workers:
            proc.join()
        for conn in self.conns:
            conn.close()
