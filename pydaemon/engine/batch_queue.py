"""Pipeline parallelism's step loop: several batches in flight, so that the stages overlap
(vLLM v1's batch queue).

With P pipeline stages a batch occupies each stage in turn; while stage 2 runs batch A,
stage 1 can run batch B only if B was launched before A's results came back. So the engine
keeps up to P batches in flight: each call schedules and launches a new batch while there is
room, and only when the queue is full (or nothing new can run) waits for the oldest batch's
output and processes it.

The batches in flight never share a sequence: a launched batch is advanced at once without
placeholders (its tokens count as computed, its sampled tokens are not there yet), so a
sequence waiting for its next token has nothing to schedule until its batch's output is
processed; a prompt's later chunk may run in the next batch (the stages run batches in
order, so its K/V lands after the earlier chunk's). Every sequence a batch samples therefore
has all its tokens on the host when the batch is launched: its grammar bitmask (structured
outputs) is filled and sent at once. The scheduler is the same as everywhere else (prefix
caching, chunked prefill): like async scheduling, it refuses to plan a batch while another is
in flight when that batch might preempt, swap, fork or run beams (``schedule(overlap=True)``
returns None); the engine then waits for the oldest batch first.
"""

from __future__ import annotations

from collections import deque

from pydaemon.core.messages import EngineCoreOutputs
from pydaemon.core.sched.scheduler import Scheduler
from pydaemon.core.sched.scheduler_output import SchedulerOutput
from pydaemon.engine.async_stepper import InFlightStep, launch, sample
from pydaemon.executor.abstract import Executor
from pydaemon.structured_output.manager import StructuredOutputManager


class BatchQueueStepper:
    """Runs engine steps with up to ``max_concurrent_batches`` batches in flight. ``step()``
    returns the outputs of at most one batch (the oldest), or nothing while the queue fills."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        structured_outputs: StructuredOutputManager,
        max_concurrent_batches: int,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.structured_outputs = structured_outputs
        self.max_concurrent_batches = max_concurrent_batches
        self.in_flight: deque[InFlightStep] = deque()
        self.max_num_in_flight = 0  # the most batches that were in flight at once

    @property
    def has_step_in_flight(self) -> bool:
        return bool(self.in_flight)

    def step(self) -> EngineCoreOutputs:
        scheduler = self.scheduler
        if (
            len(self.in_flight) < self.max_concurrent_batches
            and scheduler.has_unfinished_requests()
        ):
            out = scheduler.schedule(overlap=bool(self.in_flight))
            if out is not None:
                self._launch(out)
                if out.num_seqs and len(self.in_flight) < self.max_concurrent_batches:
                    return EngineCoreOutputs()  # room for another batch: fill the pipeline
        if not self.in_flight:
            return EngineCoreOutputs()
        return self._finish(self.in_flight.popleft())

    def finish_in_flight(self) -> EngineCoreOutputs:
        """Waits for every batch in flight and processes their results, oldest first."""
        outputs = EngineCoreOutputs()
        while self.in_flight:
            outputs.outputs.extend(self._finish(self.in_flight.popleft()).outputs)
        return outputs

    def _launch(self, out: SchedulerOutput) -> None:
        try:
            step = launch(self.executor, self.structured_outputs, out)
            # A constrained row's tokens are all on the host (see the module docstring).
            sample(self.executor, self.structured_outputs, self.scheduler, step)
        except BaseException:
            self.scheduler.discard(out)  # else every later step fails on it
            raise
        self.scheduler.advance(out, placeholders=False)
        self.in_flight.append(step)
        self.max_num_in_flight = max(self.max_num_in_flight, len(self.in_flight))

    def _finish(self, step: InFlightStep) -> EngineCoreOutputs:
        runner_output = step.runner_output.get_output()
        return self.scheduler.update_from_output(step.scheduler_output, runner_output)
