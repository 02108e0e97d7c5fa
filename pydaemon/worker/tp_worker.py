"""The ``mp`` backend's worker process (every rank but the one in the engine's process):
a ``RankWorker`` (pydaemon/worker/rank_worker.py) driven from a pipe until told to stop.

Messages on the pipe from the executor: a pickled SchedulerOutput per step, a ``RankCall``
(LoRA adapters: pydaemon/core/rank_calls.py), a pickled None to stop.
Messages to the executor: ("hello", pid) before joining the groups, ("ready", num_gpu_blocks)
once loaded, ("ok", result) or ("value_error", message) after each control call, ("error",
traceback) when anything failed. EOF on the pipe means the engine's process is gone: the
worker exits, so it never outlives the daemon. SIGINT and SIGTERM are ignored (the engine
stops the workers itself, after its drain); SIGKILL is the hard stop.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import traceback
from multiprocessing.connection import Connection

from pydaemon.core.rank_calls import RankCall
from pydaemon.worker.rank_worker import RankWorker, WorkerArgs

__all__ = ["WorkerArgs", "worker_main"]


def worker_main(args: WorkerArgs, conn: Connection) -> None:
    # The engine's process alone decides when a worker stops: Ctrl-C or systemd's SIGTERM to
    # the whole cgroup must not kill the workers under a draining daemon (it sends None).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=args.log_level,
        format=f"%(asctime)s %(levelname)s rank{args.rank} %(name)s: %(message)s",
    )
    worker = RankWorker()
    try:
        conn.send(("hello", os.getpid()))
        worker.init(args)
        conn.send(("ready", worker.runner.num_gpu_blocks))
        while True:
            message = pickle.loads(conn.recv_bytes())
            if message is None:
                break
            if isinstance(message, RankCall):
                conn.send(worker.control(message))
                continue
            worker.execute_model(message)  # builds its inputs itself, as every rank does
    except EOFError:  # the engine's process is gone
        pass
    except BaseException:  # noqa: BLE001 - reported to the executor, then the worker exits
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        raise SystemExit(1) from None
    finally:
        worker.shutdown()
