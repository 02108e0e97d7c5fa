"""Async scheduling (vLLM v1's): the host work of step N+1 overlaps the GPU work of step N.

A synchronous step is schedule -> execute (launch, sample, copy back: the host waits) ->
update, and the GPU idles through the host's part. Here, while step N runs:

1. ``schedule(overlap=True)`` plans step N+1 as if every sequence sampled in N got exactly one
   token: ``advance`` gave each of them a placeholder token, with a KV slot;
2. the executor launches N+1's forward; a placeholder's input id is gathered on the device
   from N's sampled ids (no host round trip); a step without constrained rows is sampled at
   once (``sample_tokens``);
3. only then the host waits for N's device-to-host copy and runs ``update_from_output(N)``:
   the real ids replace the placeholders (in the block manager too, before any hash of their
   block is computed), stops are checked, finished sequences are freed at once;
4. a step with constrained rows (structured outputs) is sampled now: its grammar bitmask needs
   N's tokens, which only now are on the host; the host fills it while the device still runs
   N+1's forward, and it goes down with ``sample_tokens``;
5. ``advance(N+1)``, and N+1 stays in flight for the next call.

Results do not change: a sequence that finished at N (EOS, stop id, length) or that was
aborted or stopped by the front end since N+1 was launched has its N+1 token discarded (its
blocks were freed at once; the GPU writes into them only before their next owner, in stream
order). Penalties and min_tokens read the token history, which then waits for N's copy.

The next step waits for the results of the one in flight (no overlap) when it might preempt
or swap, when a beam-search or n > 1 request is unfinished, or when speculative decoding is
due (few sequences run: a verify step's accepted run decides the next step's inputs): those
steps run synchronously (schedule, execute, update). Overlapped steps reserve no draft slots,
so with speculation configured a large batch still overlaps its steps. Every
tensor-parallel rank follows the same SchedulerOutputs: placeholders, and which steps have
them, are the same on every rank; each fills them from rank 0's sampled ids, broadcast on the
device (pydaemon/executor/multiproc_executor.py). ``launch`` and ``sample`` are the two halves
of any step, synchronous ones included (pydaemon/engine/engine_core.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydaemon.core.messages import EngineCoreOutputs
from pydaemon.core.sched.scheduler import Scheduler
from pydaemon.core.sched.scheduler_output import SchedulerOutput
from pydaemon.executor.abstract import AsyncOutput, Executor
from pydaemon.structured_output.manager import StructuredOutputManager


@dataclass
class InFlightStep:
    scheduler_output: SchedulerOutput
    runner_output: AsyncOutput | None = None  # None until sampled


def launch(
    executor: Executor, structured_outputs: StructuredOutputManager, out: SchedulerOutput
) -> InFlightStep:
    """Launches the step's forward pass. A step without constrained rows is sampled at once;
    one with them waits for ``sample`` (its bitmask needs the previous step's tokens)."""
    executor.execute_model(out)
    structured_outputs.forget(out.finished_request_ids)
    step = InFlightStep(out)
    if not out.structured_output_seq_ids:
        step.runner_output = executor.sample_tokens(None)
    return step


def sample(
    executor: Executor,
    structured_outputs: StructuredOutputManager,
    scheduler: Scheduler,
    step: InFlightStep,
) -> None:
    """Samples a launched step (once): the bitmask of its constrained rows is filled from the
    scheduler's tokens while the device runs the forward pass, then sent down."""
    if step.runner_output is None:
        grammar = structured_outputs.grammar_output(step.scheduler_output, scheduler.requests)
        step.runner_output = executor.sample_tokens(grammar)


class AsyncStepper:
    """Runs engine steps with one step in flight. ``step()`` returns the outputs of the step
    before the one it launches (nothing, the first time)."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        structured_outputs: StructuredOutputManager,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.structured_outputs = structured_outputs
        self.in_flight: InFlightStep | None = None
        self.num_overlapped_steps = 0  # steps scheduled while the previous one ran
        self.num_sync_steps = 0  # steps scheduled after the previous one's results

    @property
    def has_step_in_flight(self) -> bool:
        return self.in_flight is not None

    def step(self) -> EngineCoreOutputs:
        """One step's outputs at most: the step in flight's, else a synchronous step's."""
        scheduler = self.scheduler
        last, self.in_flight = self.in_flight, None
        if last is not None:
            scheduler_output = scheduler.schedule(overlap=True)
            if scheduler_output is None:
                return self._finish(last)  # the next call schedules after these results
            self.num_overlapped_steps += 1
            try:
                launched = self._launch(scheduler_output)
            except BaseException:
                self.in_flight = last  # still to be finished, by the next call
                raise
            outputs = self._finish(last)  # waits for the last step only now
            self._sample(launched)  # a constrained step: its bitmask needed last's tokens
            _extend(outputs, self._keep(launched))
            return outputs
        if not scheduler.has_unfinished_requests():
            return EngineCoreOutputs()
        self.num_sync_steps += 1
        launched = self._launch(scheduler.schedule())
        self._sample(launched)
        if not scheduler.can_overlap() or launched.scheduler_output.num_draft_tokens:
            # Forks, beams, swaps or drafts: their results decide the next step. Synchronous.
            return self._finish(launched)
        return self._keep(launched)

    def finish_in_flight(self) -> EngineCoreOutputs:
        """Waits for the step in flight and processes its results (nothing left running)."""
        last, self.in_flight = self.in_flight, None
        return EngineCoreOutputs() if last is None else self._finish(last)

    def _launch(self, scheduler_output: SchedulerOutput) -> InFlightStep:
        try:
            return launch(self.executor, self.structured_outputs, scheduler_output)
        except BaseException:
            self.scheduler.discard(scheduler_output)  # else every later step fails on it
            raise

    def _sample(self, step: InFlightStep) -> None:
        try:
            sample(self.executor, self.structured_outputs, self.scheduler, step)
        except BaseException:
            self.scheduler.discard(step.scheduler_output)
            raise

    def _keep(self, launched: InFlightStep) -> EngineCoreOutputs:
        """The launched step stays in flight; its tokens count as computed from now on."""
        self.scheduler.advance(launched.scheduler_output)
        self.in_flight = launched
        if self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs()
        # Every request ended (the step's work is discarded; a rejection is reported): leave
        # nothing pending while the engine idles.
        return self.finish_in_flight()

    def _finish(self, step: InFlightStep) -> EngineCoreOutputs:
        runner_output = step.runner_output.get_output()
        return self.scheduler.update_from_output(step.scheduler_output, runner_output)


def _extend(outputs: EngineCoreOutputs, more: EngineCoreOutputs) -> None:
    outputs.outputs.extend(more.outputs)
