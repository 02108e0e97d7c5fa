"""CompileService: the engine's handle on its grammar compile server (compile_server.py).

``submit`` sends a constraint to the server and returns a Future of the compiled grammar's
JSON; ``cancel`` stops a compile nobody waits for any more (its process is killed). A reader
thread resolves the futures as the server answers. The server is started on first use (or by
``start``) and again after it died or was closed; a server that dies fails the compiles it
held, with a message naming it, and the next compile starts a new one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import threading
from concurrent.futures import Future

from pydaemon.structured_output.compile_server import FrameReader, write_frame

logger = logging.getLogger(__name__)

_DIED = (
    "the grammar compile process ended (exit code {code}) during this compile; the next "
    "constrained request starts a new one"
)


class CompileService:
    def __init__(self, tokenizer_info_json: str, **lanes_kwargs) -> None:
        self._info_json = tokenizer_info_json
        self._lanes_kwargs = lanes_kwargs
        self._lock = threading.RLock()  # futures' callbacks may come back in
        self._proc: subprocess.Popen | None = None
        self._futures: dict[int, Future[str]] = {}
        self._next_id = 0
        self.key = ""  # its registry key (acquire_service)

    def start(self) -> None:
        with self._lock:
            self._ensure_started()

    def _ensure_started(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        if self._proc is not None:  # died, and its reader has not said so yet: its compiles
            lost, self._futures = self._futures, {}
            for future in lost.values():
                future.set_exception(RuntimeError(_DIED.format(code=self._proc.returncode)))
        proc = subprocess.Popen(
            [sys.executable, "-m", "pydaemon.structured_output.compile_server"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
        )
        self._proc = proc
        write_frame(proc.stdin.fileno(), ("init", self._info_json, self._lanes_kwargs))
        threading.Thread(
            target=self._read, args=(proc,), name="grammar-compile-reader", daemon=True
        ).start()
        return proc

    def submit(self, spec) -> Future[str]:
        future: Future[str] = Future()
        with self._lock:
            job_id = self._next_id
            self._next_id += 1
            future.job_id = job_id  # type: ignore[attr-defined]
            try:
                proc = self._ensure_started()
                self._futures[job_id] = future
                write_frame(proc.stdin.fileno(), ("compile", job_id, spec))
            except OSError as e:  # it could not start, or died: the next compile tries again
                self._futures.pop(job_id, None)
                future.set_exception(
                    RuntimeError(f"the grammar compile process is not running ({e})")
                )
        return future

    def cancel(self, future: Future) -> None:
        """Stops the compile of ``future`` (a no-op once it is done)."""
        with self._lock:
            job_id = getattr(future, "job_id", None)
            if self._futures.pop(job_id, None) is None:
                return
            proc = self._proc
            if proc is not None and proc.poll() is None:
                try:
                    write_frame(proc.stdin.fileno(), ("cancel", job_id))
                except OSError:
                    pass
        future.cancel()

    @property
    def num_pending(self) -> int:
        return len(self._futures)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _read(self, proc: subprocess.Popen) -> None:
        reader = FrameReader()
        fd = proc.stdout.fileno()
        try:
            while True:
                try:
                    data = os.read(fd, 1 << 20)
                except OSError:
                    data = b""
                if not data:
                    break
                for message in reader.feed(data):
                    self._answered(message)
        except Exception:  # a garbled answer: the server is stopped, its compiles fail below
            logger.exception("the grammar compile process answered what cannot be read")
            proc.kill()
        code = proc.wait()
        proc.stdout.close()
        with self._lock:
            if self._proc is not proc:
                return
            lost, self._futures = self._futures, {}
            self._proc = None
        if lost:
            logger.error("the grammar compile process ended (exit code %s)", code)
        for future in lost.values():
            future.set_exception(RuntimeError(_DIED.format(code=code)))

    def _answered(self, message) -> None:
        if message[0] == "ready":
            return
        with self._lock:
            future = self._futures.pop(message[1], None)
        if future is None:  # cancelled meanwhile
            return
        if message[0] == "done":
            future.set_result(message[2])
        else:
            future.set_exception(ValueError(message[2]))

    def close(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
            lost, self._futures = self._futures, {}
        for future in lost.values():
            future.set_exception(RuntimeError("the engine stopped during this compile"))
        if proc is not None and proc.poll() is None:
            try:
                proc.stdin.close()  # the server kills its children and exits
                proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()


# One compile server per (tokenizer, lanes) in a process, shared by the engines that use it
# (starting one costs ~3 s of imports: xgrammar, torch, transformers); one no engine uses
# is kept for the next, at most _MAX_IDLE of them, and ends with the process.
_MAX_IDLE = 2
_registry_lock = threading.Lock()
_in_use: dict[str, tuple[CompileService, int]] = {}
_idle: dict[str, CompileService] = {}  # in release order


def _key(tokenizer_info_json: str, lanes_kwargs: dict) -> str:
    digest = hashlib.sha256(tokenizer_info_json.encode())
    digest.update(repr(sorted(lanes_kwargs.items())).encode())
    return digest.hexdigest()


def acquire_service(tokenizer_info_json: str, **lanes_kwargs) -> CompileService:
    """The process's compile service for this tokenizer and these lanes (see above)."""
    key = _key(tokenizer_info_json, lanes_kwargs)
    with _registry_lock:
        service, users = _in_use.get(key, (None, 0))
        if service is None:
            service = _idle.pop(key, None) or CompileService(tokenizer_info_json, **lanes_kwargs)
            service.key = key
        _in_use[key] = (service, users + 1)
        return service


def release_service(service: CompileService) -> None:
    """An engine is done with ``service``: kept idle for the next one, or closed."""
    to_close = []
    with _registry_lock:
        key = service.key
        _, users = _in_use.get(key, (service, 1))
        if users > 1:
            _in_use[key] = (service, users - 1)
            return
        _in_use.pop(key, None)
        _idle[key] = service
        while len(_idle) > _MAX_IDLE:
            oldest = next(iter(_idle))
            to_close.append(_idle.pop(oldest))
    for idle in to_close:
        idle.close()
