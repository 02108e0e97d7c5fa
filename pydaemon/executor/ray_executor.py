"""RayExecutor: every rank a Ray actor, placed by a placement group over the Ray cluster this
process joins (the ``ray`` backend: ranks on several hosts).

Ray owns placement, process lifetime and failure detection; torch.distributed (NCCL on GPUs,
gloo on CPUs) carries the collectives between the actors, as with the ``mp`` backend. At
start: join the cluster (``ray.init(address="auto")``: the one ``ray start`` runs on this
host; none running: a local one, stopped again at shutdown), reserve one bundle per rank
(``{"GPU": 1, "CPU": 1}``, or ``{"CPU": 1}`` on CPUs; strategy PACK: a host's GPUs fill
before the next host's), create a ``RankWorker`` actor in each (pydaemon/worker/
rank_worker.py), ask where each runs (host, GPU ids), then have them all join the process
groups at rank 0's host and load their part of the model. Ranks are ordered host by host,
so that a tensor-parallel group stays within a host where it can (NVLink), and the stages
cross hosts.

One rank (TP = PP = 1) whose bundle Ray places on this process's node runs here, in the
engine core's process, as with the ``mp`` backend: the bundle is held by a placeholder
actor (Ray accounts for the GPU, no other task takes it), and this process builds its
runner on that GPU. A step then crosses no process (an actor rank cost two Ray calls and a
``ray.get`` a step: +3.4 % TPOT at batch 1 on an H100, 2026-12-07). On another node (this
one has no GPU, or none free) the rank is an actor like any other.

A step is plain data in actor method calls, each actor running its calls in order:
``execute_model`` goes to every actor at once (fire and forget); the sampling rank (tp_rank
0 of the last stage) samples in ``sample_tokens``, merged into one call with its
``execute_model`` when the step has no constrained rows (nothing to wait for); the output
is fetched by ``get_output`` only when the engine asks for it, so that a rank never blocks
its queue on a step's copy while the next step waits behind it.

Failure: a monitor thread keeps a ping queued on every actor; Ray fails a dead actor's
calls (its process died, or its host left the cluster: Ray's health checks), and a rank
whose step raised answers with the traceback (it refuses any later step, so it never
enters another collective). The monitor records which rank died or failed (a death first:
the rank that reports an error may only have seen a peer die under a collective), kills
every actor (a rank blocked in a collective on the failed one is stopped, NCCL or gloo)
and releases the placement group, so that the engine's waiting call raises and nothing is
left running.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from typing import Any

import torch

from pydaemon.config.runner import RunnerConfig
from pydaemon.core.rank_calls import RankCall
from pydaemon.core.runner_output import ModelRunnerOutput
from pydaemon.core.sched.scheduler_output import GrammarOutput, SchedulerOutput
from pydaemon.executor.abstract import AsyncOutput, Executor, ExecutorFailed
from pydaemon.model_loader.model_paths import load_model_config
from pydaemon.models.parallel import check_parallel
from pydaemon.worker.model_runner import ModelRunner
from pydaemon.worker.rank_worker import RankWorker, WorkerArgs

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 600.0  # generous: loading a large shard happens between collectives
PLACEMENT_TIMEOUT_S = 60.0  # for the cluster to reserve every bundle
PING_INTERVAL_S = 0.5  # how often an idle rank is checked
# A rank that reports a failed step may only be the first to notice a peer's death (its
# collective broke): for this long a dead rank found meanwhile is named as the cause instead.
ERROR_GRACE_S = 3.0
STOP_TIMEOUT_S = 5.0


class RayExecutorError(ExecutorFailed):
    """A Ray rank failed (or could not be placed); the engine cannot run any more steps."""


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError(
            "distributed_executor_backend 'ray' needs Ray installed: pip install 'pagedd[ray]'"
        ) from None
    return ray


class _RankOutput:
    """AsyncOutput of a step sampled on the sampling actor: fetched on the first call, and
    after every older step's (the actor hands outputs out oldest first)."""

    def __init__(self, executor: RayExecutor) -> None:
        self._executor = executor
        self._output: ModelRunnerOutput | None = None

    def get_output(self) -> ModelRunnerOutput:
        if self._output is None:
            self._executor._fetch_until(self)
        return self._output


class RayExecutor(Executor):
    def __init__(self, config: RunnerConfig) -> None:
        ray = self._ray = _import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._remove_placement_group = remove_placement_group
        tp, pp, world = (
            config.tensor_parallel_size,
            config.pipeline_parallel_size,
            config.world_size,
        )
        model_config = load_model_config(config.model)
        check_parallel(model_config, tp, pp, config.enable_expert_parallel)
        self.failure: str | None = None
        self._is_closed = False
        self._lock = threading.Lock()
        self._owns_ray = False
        self._monitor: threading.Thread | None = None  # started once every rank is up
        # The one rank, when it runs in this process (its actor only holds the bundle).
        self.driver_runner: ModelRunner | None = None
        self.sampler = None
        if not ray.is_initialized():
            try:  # the cluster `ray start` runs on this host (or RAY_ADDRESS names)
                ray.init(address="auto", logging_level=logging.WARNING)
            except ConnectionError:
                ray.init(include_dashboard=False, logging_level=logging.WARNING)
                self._owns_ray = True
                logger.info("ray: no cluster running: started a local one")
        uses_gpus = _uses_gpus(config.device, ray.cluster_resources())
        bundle = {"GPU": 1, "CPU": 1} if uses_gpus else {"CPU": 1}
        self.actors: list = []
        here = ray.get_runtime_context().get_node_id()
        if world == 1:  # this node first: the rank can then run in this process
            self._pg = placement_group(
                [dict(bundle)], strategy="STRICT_PACK", _soft_target_node_id=here
            )
        else:
            self._pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
        atexit.register(self.shutdown)
        try:
            ready, _ = ray.wait([self._pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                raise RayExecutorError(
                    f"the Ray cluster could not place {world} ranks (TP {tp} x PP {pp}) of "
                    f"{bundle} each within {PLACEMENT_TIMEOUT_S:.0f} s; it has "
                    f"{ray.cluster_resources()}, of which {ray.available_resources()} free"
                )
            actor_class = ray.remote(RankWorker)
            actors = [
                actor_class.options(
                    num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self._pg, placement_group_bundle_index=i
                    ),
                ).remote()
                for i in range(world)
            ]
            self.actors = actors
            places = ray.get([a.where.remote() for a in actors])
            # Ranks node by node (the driver's node first), GPUs in order within a node.
            order = sorted(
                range(world),
                key=lambda i: (places[i][0] != here, places[i][0], [int(g) for g in places[i][3]]),
            )
            self.actors = [actors[i] for i in order]
            self.places = [places[i] for i in order]  # (node id, address, pid, gpu ids) by rank
            if world == 1 and self.places[0][0] == here:
                self.driver_runner = _local_runner(config, self.places[0][3])
            if self.driver_runner is not None:
                self.info = self.driver_runner.runner_info()
                self.model_config = self.driver_runner.model_config
            else:
                backend = self._start_ranks(config, tp, pp, uses_gpus)
        except BaseException as e:
            self.shutdown()
            if isinstance(e, ExecutorFailed | ValueError):
                raise
            raise RayExecutorError(f"the Ray ranks failed to start: {e}") from e
        self._deferred: SchedulerOutput | None = None  # the sampling rank's step, not sent
        self._unfetched: list[_RankOutput] = []  # sampled steps, oldest first
        if self.driver_runner is not None:
            logger.info("ray: the one rank runs in this process (Ray holds its bundle)")
            return
        self._monitor = threading.Thread(target=self._watch, name="pagedd-ray-monitor", daemon=True)
        self._monitor.start()
        logger.info(
            "ray: TP %d x PP %d ranks over %s on %s",
            tp,
            pp,
            backend,
            ", ".join(f"rank {r}: {h} pid {p}" for r, (_, h, p, _) in enumerate(self.places)),
        )

    def _start_ranks(self, config: RunnerConfig, tp: int, pp: int, uses_gpus: bool) -> str:
        """Has every actor join the process groups and load its part; -> the backend."""
        ray = self._ray
        host0 = self.places[0][1]
        init_method = f"tcp://{host0}:{ray.get(self.actors[0].free_port.remote(host0))}"
        backend = "nccl" if uses_gpus else "gloo"
        pending = [
            actor.init.remote(self._worker_args(config, rank, backend, init_method))
            for rank, actor in enumerate(self.actors)
        ]
        while pending:  # the first rank that fails ends the wait (its peers wait for it)
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done[0])
        self.sampler = self.actors[(pp - 1) * tp]  # tp_rank 0 of the last stage
        self.info, self.model_config, _ = ray.get(self.sampler.runner_info.remote())
        return backend

    def _worker_args(
        self, config: RunnerConfig, rank: int, backend: str, init_method: str
    ) -> WorkerArgs:
        node_id, _, _, gpu_ids = self.places[rank]
        visible = local_rank = None
        if gpu_ids:  # every GPU Ray gave this node's ranks, so that NCCL sees its peers
            node_gpus = sorted(
                {g for n, _, _, ids in self.places if n == node_id for g in ids}, key=int
            )
            visible, local_rank = ",".join(node_gpus), node_gpus.index(gpu_ids[0])
        return WorkerArgs(
            rank,
            config.world_size,
            backend,
            init_method,
            COLLECTIVE_TIMEOUT_S,
            config,
            logging.getLogger().getEffectiveLevel(),
            local_rank=0 if local_rank is None else local_rank,
            visible_devices=visible,
        )

    # ---- the step ---------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self._raise_if_failed()
        if self.driver_runner is not None:
            self.driver_runner.execute_model(scheduler_output)
            return
        for actor in self.actors:
            if actor is not self.sampler:
                actor.execute_model.remote(scheduler_output)
        if scheduler_output.structured_output_seq_ids:  # its bitmask comes later
            self.sampler.execute_model.remote(scheduler_output)
        else:  # sample_tokens(None) follows at once: one call for both
            self._deferred = scheduler_output

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> AsyncOutput:
        self._raise_if_failed()
        if self.driver_runner is not None:
            return self.driver_runner.sample_tokens(grammar_output)
        out, self._deferred = self._deferred, None
        if out is not None:
            self.sampler.execute_and_sample.remote(out, grammar_output)
        else:
            self.sampler.sample_tokens.remote(grammar_output)
        result = _RankOutput(self)
        self._unfetched.append(result)
        return result

    def _fetch_until(self, target: _RankOutput) -> None:
        """Fetches the sampled outputs, oldest first, up to ``target``'s."""
        ray = self._ray
        while target._output is None:
            oldest = self._unfetched.pop(0)
            try:
                oldest._output = ray.get(self.sampler.get_output.remote())
            except Exception as e:
                raise RayExecutorError(self._wait_failure() or f"a Ray rank failed: {e}") from e

    # ---- control calls (LoRA), on every rank ------------------------------------------------
    def control(self, call: RankCall) -> Any:
        """Runs ``call`` on every rank's runner, in order with the steps; ValueError if any
        rank raised it. -> the sampling rank's result."""
        self._raise_if_failed()
        if self.driver_runner is not None:
            return call.run(self.driver_runner)
        try:
            replies = self._ray.get([a.control.remote(call) for a in self.actors])
        except Exception as e:
            raise RayExecutorError(self._wait_failure() or f"a Ray rank failed: {e}") from e
        problems = [payload for kind, payload in replies if kind == "value_error"]
        if problems:
            raise ValueError(problems[0])
        return replies[self.actors.index(self.sampler)][1]

    # ---- failures ---------------------------------------------------------------------------
    @property
    def is_failed(self) -> bool:
        return self.failure is not None

    def check_health(self) -> None:
        """Raises RayExecutorError once a rank has failed (the monitor finds out)."""
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise RayExecutorError(self.failure)

    def _wait_failure(self, timeout_s: float = ERROR_GRACE_S + 5.0) -> str | None:
        """After a failed call: the monitor's account of it (it may take a moment)."""
        deadline = time.monotonic() + timeout_s
        while self.failure is None and time.monotonic() < deadline and not self._is_closed:
            time.sleep(0.05)
        return self.failure

    def _watch(self) -> None:
        """Keeps one ping queued on each actor. A ping that fails names a dead rank at once;
        one that returns a traceback names its rank after ``ERROR_GRACE_S`` unless a dead
        rank shows up meanwhile."""
        ray = self._ray
        pings = {actor.ping.remote(): rank for rank, actor in enumerate(self.actors)}
        reported: tuple[int, str, float] | None = None  # (rank, traceback, when)
        while not self._is_closed:
            start = time.monotonic()
            done, _ = ray.wait(list(pings), num_returns=len(pings), timeout=PING_INTERVAL_S)
            for ref in done:
                rank = pings.pop(ref)
                try:
                    error = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - the actor is gone
                    if not self._is_closed:
                        _, host, pid, _ = self.places[rank]
                        self._fail(f"Ray rank {rank} (host {host}, pid {pid}) died: {e}")
                    return
                if error is None:
                    pings[self.actors[rank].ping.remote()] = rank
                elif reported is None:
                    reported = (rank, error, time.monotonic())
            if reported is not None and time.monotonic() - reported[2] > ERROR_GRACE_S:
                rank, error, _ = reported
                _, host, pid, _ = self.places[rank]
                self._fail(f"Ray rank {rank} (host {host}, pid {pid}) failed:\n{error}")
                return
            time.sleep(max(0.0, PING_INTERVAL_S - (time.monotonic() - start)))

    def _fail(self, failure: str) -> None:
        self.failure = failure
        logger.error("%s; stopping the other ranks", failure)
        self._kill_actors()

    # ---- shutdown ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stops every rank and releases its resources (idempotent; also run at exit)."""
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
        atexit.unregister(self.shutdown)
        ray = self._ray
        if self.driver_runner is not None:
            self.driver_runner.shutdown()  # the KV copies in flight; the disk tier's file
        elif self.actors and self.failure is None:
            try:  # each rank leaves its process groups (graphs before communicators)
                ray.wait(
                    [a.shutdown.remote() for a in self.actors],
                    num_returns=len(self.actors),
                    timeout=STOP_TIMEOUT_S,
                )
            except Exception:  # noqa: BLE001 - the kill below stops them anyway
                pass
        monitor = self._monitor
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(2 * PING_INTERVAL_S + 1.0)  # no Ray call may follow ray.shutdown
        self._kill_actors()
        if self._owns_ray:
            ray.shutdown()

    def _kill_actors(self) -> None:
        for actor in self.actors:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self._pg is not None:
            try:
                self._remove_placement_group(self._pg)
            except Exception:  # noqa: BLE001
                pass
            self._pg = None


def _local_runner(config: RunnerConfig, gpu_ids: list[str]) -> ModelRunner | None:
    """The one rank's runner in this process, on the GPU Ray gave its bundle (as this process
    sees it: CUDA_VISIBLE_DEVICES may renumber); None where this process cannot see that GPU
    (the rank then runs in its actor)."""
    if gpu_ids:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible is not None else None
        if ids is not None and gpu_ids[0] not in ids:
            return None
        index = ids.index(gpu_ids[0]) if ids is not None else int(gpu_ids[0])
        if index >= torch.cuda.device_count():
            return None
        torch.cuda.set_device(index)  # "cuda" is this device from here on
    return ModelRunner(config)


def _uses_gpus(device: str, cluster_resources: dict) -> bool:
    """Ranks on GPUs: device "cuda", or "auto" when the cluster has GPUs."""
    if device == "cuda":
        return True
    return device == "auto" and cluster_resources.get("GPU", 0) > 0
