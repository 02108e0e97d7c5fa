"""Starting the engine-core process: spawn it, then wait until it is loaded, warm and ready.

Spawned (not forked: CUDA and threads do not survive a fork), so the child imports the main
module again; a script that starts an engine must do so under ``if __name__ == "__main__":``,
and the error says so when the process dies before it could start.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import time
from multiprocessing.connection import Connection

from pydaemon.config.engine import EngineConfig
from pydaemon.core.messages import CoreReady, CoreStartupFailed
from pydaemon.engine.core_proc import run_engine_core

START_TIMEOUT_S = 3600.0  # loading a large model from a slow disk
_MAIN_GUARD_HINT = (
    " (from a script: a spawned process imports the main module again, so a script that "
    'starts an engine must do so under `if __name__ == "__main__":`)'
)


def start_engine_core(config: EngineConfig, eos_token_ids: list[int]):
    """-> (process, the front end's end of the pipe, its CoreReady). ``eos_token_ids``: the
    front end's (the core adds its model config's). Blocking; raises
    ValueError for a bad setting the core reported, RuntimeError for anything else."""
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe(duplex=True)
    log_level = logging.getLogger().getEffectiveLevel()
    # Not a daemon process: it starts tensor-parallel workers of its own.
    process = ctx.Process(
        target=run_engine_core,
        args=(config, child_conn, eos_token_ids, log_level),
        name="pagedd-engine-core",
    )
    process.start()
    child_conn.close()  # the core's end lives in the core only: EOF when it dies
    try:
        ready = _wait_ready(process, conn)
    except BaseException:
        process.kill()
        process.join()
        conn.close()
        raise
    return process, conn, ready


def _wait_ready(process, conn: Connection) -> CoreReady:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not conn.poll(0.1):
        if not process.is_alive():
            process.join()
            raise RuntimeError(
                f"the engine-core process (pid {process.pid}) exited with code "
                f"{process.exitcode} before it was ready{_MAIN_GUARD_HINT}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine core was not ready within {START_TIMEOUT_S:.0f} s")
    try:
        message = pickle.loads(conn.recv_bytes())
    except EOFError:
        process.join()
        raise RuntimeError(
            f"the engine-core process (pid {process.pid}) exited with code "
            f"{process.exitcode} before it was ready{_MAIN_GUARD_HINT}"
        ) from None
    if isinstance(message, CoreStartupFailed):
        if message.is_bad_setting:
            raise ValueError(message.message)
        raise RuntimeError(f"the engine core failed to start:\n{message.message}")
    return message
