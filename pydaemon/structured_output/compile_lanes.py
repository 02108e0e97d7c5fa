"""CompileLanes: which grammar compile runs when, and which is stopped (no I/O: the compile
server drives it with its clock).

A compile's time cannot be told from a constraint's size (a 24-byte regex of nested bounded
repeats compiles for minutes), so every compile runs in a process that can be killed
(compile_server.py), and this policy bounds what one compile costs the others:

- Every compile starts in the fast lane. One that runs past ``fast_budget_s`` becomes *slow*.
- At most one slow compile runs at a time: a second compile that turns slow while one runs is
  stopped and queued in the slow lane, to start again from the beginning when the slow slot
  is free (compiles are deterministic; it loses at most ``fast_budget_s``).
- Of ``max_running`` slots, the slow compile takes at most one, so a small constraint waits
  at most ``fast_budget_s`` for each compile queued before it, whatever else compiles.
- A compile that runs past ``deadline_s`` in the slow lane is stopped and fails, naming the
  limit. A compile whose requests all left is stopped at once (``cancel``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

DEFAULT_FAST_BUDGET_S = 2.0
DEFAULT_DEADLINE_S = 30.0


@dataclass
class CompileJob:
    job_id: int
    payload: Any = None
    started: float | None = None  # when its current run began (None: queued)
    slow: bool = False  # ran past the fast budget: it is (or waits for) the slow compile


@dataclass
class LaneActions:
    """What a ``tick`` asks for: start these, stop these (killed, queued again), fail these
    (killed, with the reason its requests get)."""

    start: list[CompileJob] = field(default_factory=list)
    stop: list[CompileJob] = field(default_factory=list)
    fail: list[tuple[CompileJob, str]] = field(default_factory=list)


class CompileLanes:
    def __init__(
        self,
        *,
        max_running: int = 2,
        fast_budget_s: float = DEFAULT_FAST_BUDGET_S,
        deadline_s: float = DEFAULT_DEADLINE_S,
    ) -> None:
        if max_running < 2:
            raise ValueError("compile lanes need two slots at least: one stays for fast ones")
        self.max_running = max_running
        self.fast_budget_s = fast_budget_s
        self.deadline_s = deadline_s
        self._fast: deque[CompileJob] = deque()
        self._slow: deque[CompileJob] = deque()
        self.running: dict[int, CompileJob] = {}

    def add(self, job: CompileJob) -> None:
        self._fast.append(job)

    def cancel(self, job_id: int) -> CompileJob | None:
        """Forgets a job; -> it when it was running (the caller kills its process)."""
        for lane in (self._fast, self._slow):
            for job in lane:
                if job.job_id == job_id:
                    lane.remove(job)
                    return None
        return self.running.pop(job_id, None)

    def finished(self, job_id: int) -> CompileJob | None:
        """A running job's process ended (done, failed or died)."""
        return self.running.pop(job_id, None)

    @property
    def num_queued(self) -> int:
        return len(self._fast) + len(self._slow)

    def _slow_running(self) -> CompileJob | None:
        return next((j for j in self.running.values() if j.slow), None)

    def tick(self, now: float) -> LaneActions:
        actions = LaneActions()
        for job in list(self.running.values()):
            ran = now - job.started
            if job.slow and ran > self.deadline_s:
                del self.running[job.job_id]
                actions.fail.append(
                    (
                        job,
                        f"structured_outputs: the grammar did not compile within "
                        f"{self.deadline_s:g} s (--structured-outputs-compile-timeout); a "
                        "smaller constraint, or fewer nested repeats, compiles faster",
                    )
                )
            elif not job.slow and ran > self.fast_budget_s:
                if self._slow_running() is None:
                    job.slow = True  # it goes on as the slow compile; its deadline counts on
                else:
                    del self.running[job.job_id]
                    job.slow, job.started = True, None
                    self._slow.append(job)
                    actions.stop.append(job)
        while len(self.running) < self.max_running:
            if self._fast:
                job = self._fast.popleft()
            elif self._slow and self._slow_running() is None:
                job = self._slow.popleft()
            else:
                break
            job.started = now
            self.running[job.job_id] = job
            actions.start.append(job)
        return actions

    def next_event(self, now: float) -> float | None:
        """Seconds until a running job crosses its budget or deadline (None: none runs)."""
        waits = [
            job.started + (self.deadline_s if job.slow else self.fast_budget_s) - now
            for job in self.running.values()
        ]
        return max(0.0, min(waits)) if waits else None
