"""The tensor-parallel worker process (ranks 1..N-1): joins the group, builds its shard of
the model and of the KV cache, then runs every step rank 0 sends until told to stop.

Messages on the pipe from rank 0: a pickled SchedulerOutput per step, a ``ControlCall``
(LoRA adapters: a runner method and its arguments), a pickled None to stop.
Messages to rank 0: ("hello", pid) before joining the group, ("ready", num_gpu_blocks)
once loaded, ("ok", result) or ("value_error", message) after each control call, ("error",
traceback) when anything failed. EOF on the pipe means rank 0 is
gone: the worker exits, so it never outlives the daemon. SIGINT and SIGTERM are ignored
(rank 0 stops the workers itself, after its drain); SIGKILL is the hard stop.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from pydaemon import heap_freeze
from pydaemon.config.engine import EngineConfig


@dataclass
class ControlCall:
    """Rank 0 -> worker: run ``ModelRunner.<method>(*args)`` between two steps and reply."""

    method: str  # "add_lora" | "remove_lora"
    args: tuple


@dataclass
class WorkerArgs:
    rank: int
    world_size: int
    backend: str  # "nccl" | "gloo"
    init_method: str  # tcp://127.0.0.1:PORT
    timeout_s: float  # of every collective
    config: EngineConfig  # the engine's, with the model directory resolved
    log_level: int


def worker_main(args: WorkerArgs, conn: Connection) -> None:
    # Rank 0 alone decides when a worker stops: Ctrl-C or systemd's SIGTERM to the whole
    # cgroup must not kill the workers under a draining daemon (it sends the stop message).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=args.log_level,
        format=f"%(asctime)s %(levelname)s tp-rank{args.rank} %(name)s: %(message)s",
    )
    import torch

    from pydaemon.distributed import parallel_state as ps
    from pydaemon.worker.model_runner import ModelRunner

    if args.backend == "gloo":  # CPU ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    runner = None
    try:
        conn.send(("hello", os.getpid()))
        ps.init_tensor_parallel(
            args.rank, args.world_size, args.backend, args.init_method, args.timeout_s
        )
        runner = ModelRunner(args.config)
        heap_freeze.freeze_startup_heap()  # no full collection walks the model in the loop
        conn.send(("ready", runner.num_gpu_blocks))
        while True:
            message = pickle.loads(conn.recv_bytes())
            if message is None:
                break
            if isinstance(message, ControlCall):
                try:
                    conn.send(("ok", getattr(runner, message.method)(*message.args)))
                except ValueError as e:  # a bad adapter: rank 0 refuses it, the worker lives
                    conn.send(("value_error", str(e)))
                continue
            runner.execute_model(message)  # builds its inputs itself, as rank 0 does
            runner.sample_tokens(None)  # rank 0 samples; this rank takes its ids later
    except EOFError:  # rank 0 is gone
        pass
    except BaseException:  # noqa: BLE001 - reported to rank 0, then the worker exits
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        raise SystemExit(1) from None
    finally:
        if runner is not None:
            runner.release_cuda_graphs()  # before the communicator they captured goes
            runner.shutdown()  # the KV copies in flight; the disk tier's file
        ps.destroy_tensor_parallel()
