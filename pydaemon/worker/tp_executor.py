"""TensorParallelExecutor: runs the model over N ranks; this process is rank 0.

It starts ranks 1..N-1 as spawned worker processes (one per GPU; gloo on CPUs), joins the
process group as rank 0, builds rank 0's ModelRunner (its shard of the weights and of the
KV cache, with the same number of blocks on every rank) and, for every step, sends the
step's plain SchedulerOutput to each worker before running it itself. Every rank builds its
inputs from it in its own runner (no rank is special until sampling); the collectives
inside the model keep the ranks in lockstep, and the logits are gathered on rank 0, which
samples. Under async scheduling a step's placeholder tokens (the last step's samples, not yet
on the host) are filled on every rank from rank 0's sampled ids, broadcast device to device
(``ModelRunner._share_sampled_ids``).

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
import socket
import threading
import time

import torch

from pydaemon.config.engine import EngineConfig
from pydaemon.core.runner_output import AsyncModelRunnerOutput, ModelRunnerOutput
from pydaemon.core.sched.scheduler_output import SchedulerOutput
from pydaemon.distributed import parallel_state as ps
from pydaemon.model_loader.loader import load_model_config
from pydaemon.models import get_model_class
from pydaemon.worker.model_runner import ModelRunner, resolve_device
from pydaemon.worker.tp_worker import WorkerArgs, worker_main

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 600.0  # generous: loading a large shard happens between collectives
START_TIMEOUT_S = 120.0  # for a spawned worker to import torch and say hello
STOP_TIMEOUT_S = 5.0


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker failed; the engine cannot run any more steps."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelExecutor:
    def __init__(self, config: EngineConfig) -> None:
        tp = config.tensor_parallel_size
        if tp < 2:
            raise ValueError(f"TensorParallelExecutor needs tensor_parallel_size >= 2, got {tp}")
        model_config = load_model_config(config.model)
        get_model_class(model_config.architecture).check_tensor_parallel(model_config, tp)
        device = resolve_device(config.device, 0, tp)
        backend = "nccl" if device.type == "cuda" else "gloo"
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.world_size = tp
        self.failure: str | None = None  # set once a worker failed
        self.runner: ModelRunner | None = None  # rank 0's, once built
        self._is_closed = False
        self._lock = threading.Lock()
        self._probe_lock = threading.Lock()
        ctx = torch.multiprocessing.get_context("spawn")
        self.workers: list = []
        self.conns: list[multiprocessing.connection.Connection] = []
        atexit.register(self.shutdown)
        for rank in range(1, tp):
            parent_conn, child_conn = ctx.Pipe()
            args = WorkerArgs(
                rank,
                tp,
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
            ps.init_tensor_parallel(0, tp, backend, init_method, COLLECTIVE_TIMEOUT_S)
            self.runner = ModelRunner(config)
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
            "tensor parallel: %d ranks over %s (workers: pids %s)",
            tp,
            backend,
            ", ".join(str(p.pid) for p in self.workers),
        )

    # ---- the step ---------------------------------------------------------------------------
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """ModelRunner.execute_model over every rank; rank 0's output."""
        return self.execute_model_async(out).get_output()

    def execute_model_async(self, out: SchedulerOutput) -> AsyncModelRunnerOutput:
        """ModelRunner.execute_model_async over every rank: returns once rank 0 launched the
        step (async scheduling). A worker never waits for its GPU either: it launches its part
        and reads the next step from its pipe while this one runs."""
        if self.failure is not None:  # set by the monitor thread; no probing on the hot path
            raise TensorParallelError(self.failure)
        try:
            self._broadcast(out)
            return self.runner.execute_model_async(out)
        except Exception as e:
            failure = self._wait_failure()
            raise TensorParallelError(failure or f"tensor-parallel step failed: {e!r}") from e

    def _broadcast(self, out: SchedulerOutput | None, ignore_errors: bool = False) -> None:
        """Sends the step (None: stop) to every worker; pickled once."""
        data = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            try:
                conn.send_bytes(data)
            except OSError:
                if not ignore_errors:
                    raise

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
        for rank, (proc, conn) in enumerate(zip(self.workers, self.conns, strict=True), start=1):
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
        for rank, (proc, conn) in enumerate(zip(self.workers, self.conns, strict=True), start=1):
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
            ps.abort_tensor_parallel()
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
        if self.runner is not None:
            self.runner.release_cuda_graphs()  # before the communicator they captured goes
        ps.destroy_tensor_parallel()

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
