"""The grammar compile server: a process of its own that compiles each grammar in a child it
forks, so that a compile can be stopped (xgrammar compiles in C++ and cannot be interrupted;
a thread cannot be killed).

Started by CompileService (compile_service.py) as ``python -m pydaemon.structured_output.
compile_server``; it speaks length-prefixed pickles on stdin/stdout:

- in: ``("init", tokenizer_info_json, lanes_kwargs)`` once, then ``("compile", job_id,
  spec)`` and ``("cancel", job_id)``;
- out: ``("ready",)``, then ``("done", job_id, compiled_json)`` or ``("error", job_id,
  message)`` for each job that was not cancelled.

The server stays single-threaded, so forking it is safe (the engine-core process, which has
threads, never forks). Each child builds and compiles one grammar and writes the compiled
grammar's JSON (xgrammar's serialize_json) to a pipe; CompileLanes (compile_lanes.py) decides
which child runs and which is killed. The server ends, killing its children, when its stdin
closes (the engine stopped or died); a child dies with the server (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import os
import pickle
import selectors
import signal
import struct
import sys
import time

_HEADER = struct.Struct("<I")
_PR_SET_PDEATHSIG = 1


_out_fd = 1  # main() moves the protocol off fd 1, so that a stray print cannot corrupt it


def encode_frame(message) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def write_frame(fd: int, message) -> None:
    view = memoryview(encode_frame(message))
    while view:
        view = view[os.write(fd, view) :]


class FrameReader:
    """Frames out of a byte stream read in pieces."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list:
        self._buf += data
        frames = []
        while len(self._buf) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buf)
            if len(self._buf) < _HEADER.size + size:
                break
            frames.append(pickle.loads(bytes(self._buf[_HEADER.size : _HEADER.size + size])))
            del self._buf[: _HEADER.size + size]
        return frames


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the child ends when its compile does


# Memory a compile may take beyond what the server had when it forked (the address space is
# bounded: a grammar whose compile explodes fails, "MemoryError" or a killed child, instead of
# taking the host's memory before its deadline).
COMPILE_MEMORY_BYTES = 4 << 30


def _bound_memory() -> None:
    try:
        import resource

        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = mapped + COMPILE_MEMORY_BYTES
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, OSError, ValueError):
        pass  # not Linux: the deadline still bounds the compile


def _compile_in_child(write_fd: int, tokenizer_info, spec) -> None:
    """In the forked child: compile, write b"O" + JSON or b"E" + message, and exit."""
    _die_with_parent()
    _bound_memory()
    try:
        import xgrammar as xgr

        from pydaemon.structured_output.grammar_spec import build_grammar

        compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)
        compiled = compiler.compile_grammar(build_grammar(spec))
        bitmask = xgr.allocate_token_bitmask(1, tokenizer_info.vocab_size)
        matcher = xgr.GrammarMatcher(compiled)
        matcher.fill_next_token_bitmask(bitmask)
        if not bool(bitmask.any()) and not matcher.is_terminated():
            raise ValueError(
                "structured_outputs: the constraint can never be satisfied: its grammar "
                "accepts no text (a rule or schema defined only by itself, say)"
            )
        result = b"O" + compiled.serialize_json().encode()
    except BaseException as e:  # every failure goes back as a message
        from pydaemon.structured_output.grammar_spec import _message

        text = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {_message(e)}"
        result = b"E" + text.encode("utf-8", "replace")
    try:
        view = memoryview(result)
        while view:
            view = view[os.write(write_fd, view) :]
    finally:
        os._exit(0)


class CompileServer:
    def __init__(self, tokenizer_info, lanes_kwargs: dict) -> None:
        from pydaemon.structured_output.compile_lanes import CompileLanes

        self.tokenizer_info = tokenizer_info
        self.lanes = CompileLanes(**lanes_kwargs)
        self.selector = selectors.DefaultSelector()
        self.children: dict[int, tuple[int, int, bytearray]] = {}  # job -> (pid, read fd, out)
        self.specs: dict[int, object] = {}

    def start(self, job) -> None:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child
            os.close(read_fd)
            if _out_fd != 1:
                os.close(_out_fd)
            _compile_in_child(write_fd, self.tokenizer_info, job.payload)
        os.close(write_fd)
        self.children[job.job_id] = (pid, read_fd, bytearray())
        self.selector.register(read_fd, selectors.EVENT_READ, job.job_id)

    def kill(self, job_id: int) -> None:
        child = self.children.pop(job_id, None)
        if child is None:
            return
        pid, read_fd, _ = child
        self.selector.unregister(read_fd)
        os.close(read_fd)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)

    def child_output(self, job_id: int) -> None:
        pid, read_fd, out = self.children[job_id]
        data = os.read(read_fd, 1 << 20)
        if data:
            out += data
            return
        del self.children[job_id]
        self.selector.unregister(read_fd)
        os.close(read_fd)
        _, status = os.waitpid(pid, 0)
        self.lanes.finished(job_id)
        self.specs.pop(job_id, None)
        if out[:1] == b"O":
            write_frame(_out_fd, ("done", job_id, out[1:].decode()))
        elif out[:1] == b"E":
            write_frame(_out_fd, ("error", job_id, out[1:].decode("utf-8", "replace")))
        else:
            how = (
                f"signal {signal.Signals(-os.waitstatus_to_exitcode(status)).name}"
                if os.WIFSIGNALED(status)
                else f"exit status {os.waitstatus_to_exitcode(status)}"
            )
            write_frame(_out_fd, ("error", job_id, f"the grammar's compile process died ({how})"))

    def command(self, message) -> None:
        from pydaemon.structured_output.compile_lanes import CompileJob

        if message[0] == "compile":
            _, job_id, spec = message
            self.lanes.add(CompileJob(job_id, spec))
        elif message[0] == "cancel":
            if self.lanes.cancel(message[1]) is not None:
                self.kill(message[1])

    def apply(self, now: float) -> None:
        actions = self.lanes.tick(now)
        for job in actions.stop:
            self.kill(job.job_id)
        for job, reason in actions.fail:
            self.kill(job.job_id)
            write_frame(_out_fd, ("error", job.job_id, reason))
        for job in actions.start:
            self.start(job)

    def serve(self, reader: FrameReader) -> None:
        """Until stdin closes; ``reader`` holds what was read after the init frame."""
        self.selector.register(0, selectors.EVENT_READ, None)
        while True:
            timeout = self.lanes.next_event(time.monotonic())
            for key, _ in self.selector.select(None if timeout is None else timeout + 0.01):
                if key.data is not None:
                    self.child_output(key.data)
                    continue
                data = os.read(0, 1 << 20)
                if not data:
                    return  # the engine is gone
                for message in reader.feed(data):
                    self.command(message)
            self.apply(time.monotonic())

    def close(self) -> None:
        for job_id in list(self.children):
            self.kill(job_id)


def main() -> None:
    global _out_fd
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon's Ctrl-C is the engine's to handle
    _die_with_parent()
    _out_fd = os.dup(1)
    os.dup2(2, 1)  # what anything prints goes to the daemon's log, not into the protocol
    reader = FrameReader()
    init = None
    while init is None:
        data = os.read(0, 1 << 20)
        if not data:
            return
        frames = reader.feed(data)
        if frames:
            init = frames[0]
    import xgrammar as xgr

    _, info_json, lanes_kwargs = init
    server = CompileServer(xgr.TokenizerInfo.deserialize_json(info_json), lanes_kwargs)
    write_frame(_out_fd, ("ready",))
    try:
        for message in frames[1:]:
            server.command(message)
        server.apply(time.monotonic())
        server.serve(reader)
    finally:
        server.close()


if __name__ == "__main__":
    sys.exit(main())
