"""Host time of one decode step, without a model: schedule(), the runner's input building from
the SchedulerOutput (InputBatch.update + prepare), and update_from_output().

The device work (forward pass, sampling) is left out on purpose: this is the part of a step
the GPU waits for. A batch of ``--num-seqs`` sequences with W1-like prompt lengths decodes
``--steps`` steps; the median per step is reported, split by phase.

    PYTHONPATH=. python bench/bench_host_step.py                 # 512 sequences
    PYTHONPATH=. python bench/bench_host_step.py --num-seqs 256
    PYTHONPATH=. python bench/bench_host_step.py --async-scheduling  # the overlapped order

``--async-scheduling`` runs the phases in async scheduling's order (pydaemon/engine/async_stepper.py):
schedule(overlap=True) on placeholder tokens, the inputs with placeholders, then the update of
the step before, then ``advance``; this host time is what hides behind the GPU's step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np

from pydaemon.core.request import Request, Sequence
from pydaemon.core.runner_output import ModelRunnerOutput
from pydaemon.core.sched.scheduler import Scheduler
from pydaemon.core.sched.scheduler_config import SchedulerConfig
from pydaemon.core.stop_checker import StopChecker
from pydaemon.outputs import RequestMetrics
from pydaemon.sampling_params import SamplingParams
from pydaemon.worker.input_batch import InputBatch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-seqs", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--async-scheduling", action="store_true")
    args = parser.parse_args(argv)

    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, 30000) for _ in range(rng.randint(64, 1024))]
        for _ in range(args.num_seqs)
    ]
    num_blocks = sum(len(p) + args.steps + 1 for p in prompts) // args.block_size + 2 * len(prompts)
    scheduler = Scheduler(
        SchedulerConfig(
            block_size=args.block_size,
            num_gpu_blocks=num_blocks,
            max_num_seqs=args.num_seqs,
            max_num_batched_tokens=1 << 30,
            max_model_len=args.max_model_len,
        )
    )
    batch = InputBatch(args.num_seqs, args.max_model_len, args.block_size)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        request = Request(
            f"r{i}", prompt, params, set(), metrics=RequestMetrics(arrival_time=float(i))
        )
        request.stop_checker = StopChecker(params, set())
        request.seqs.append(Sequence.new(0, prompt))
        scheduler.add_request(request)

    phases: dict[str, list[float]] = {"schedule": [], "runner inputs": [], "update": []}
    last = None  # async: (SchedulerOutput, ModelRunnerOutput) of the step "in flight"
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        out = scheduler.schedule(overlap=last is not None)
        if out is None:
            raise RuntimeError("the overlapped schedule was refused")
        t1 = time.perf_counter()
        batch.update(out, None if last is None else (lambda ro=last[1]: ro))
        inputs = batch.prepare(out)
        t2 = time.perf_counter()
        sampled = np.asarray(inputs.seq_ids)[inputs.is_sampled].tolist()
        runner_output = ModelRunnerOutput(
            seq_ids=sampled,
            sampled_token_ids=[[1000 + step]] * len(sampled),
            chosen_logprobs=[[-1.0]] * len(sampled),
            logprobs=[[None]] * len(sampled),
        )
        t3 = time.perf_counter()
        if not args.async_scheduling:
            scheduler.update_from_output(out, runner_output)
        else:
            if last is not None:
                scheduler.update_from_output(*last)
            scheduler.advance(out)
            last = (out, runner_output)
        t4 = time.perf_counter()
        if step == 0:
            continue  # the prefill step
        phases["schedule"].append(t1 - t0)
        phases["runner inputs"].append(t2 - t1)
        phases["update"].append(t4 - t3)
    total = 0.0
    mode = "async scheduling" if args.async_scheduling else "synchronous"
    print(f"decode step ({mode}), {args.num_seqs} sequences, median of {args.steps} steps:")
    for name, values in phases.items():
        median = statistics.median(values) * 1e3
        total += median
        print(f"  {name:14s} {median:7.3f} ms")
    print(f"  {'total':14s} {total:7.3f} ms (device work and sampling not included)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
