"""Whole-step profile of the engine core on a GPU: where a decode step's time goes.

Loads a model (W1's dummy Llama-3-8B by default), admits ``--num-seqs`` requests with W1
prompts, steps until every prompt is prefilled, then times ``--steps`` decode steps two ways:

- host phases with ``time.perf_counter``: ``schedule()``, ``execute_model()`` (input building,
  launches, sampling and its one device-to-host copy) and ``update_from_output()``;
- device work with ``torch.profiler``: CUDA kernel time per step grouped by kind (MoE, GEMM,
  attention, norm, rotary (or rotary+cache, the fused kernel), activation, sampling, copies,
  other), and the share of the step's wall time the GPU was busy.

``--async-scheduling both`` then times the same engine, in the same batch state, with async
scheduling (pydaemon/engine/async_stepper.py: step N+1 scheduled and launched while step N runs), one
block of steps of each kind after the other, and reports both walls and the ratio.

The summary is printed as a table and written as JSON (``--out``).

    python bench/profile_step.py --model /tmp/l3 --load-format dummy --out profile.json
    python bench/profile_step.py --model /tmp/l3 --load-format dummy --async-scheduling both
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import kernel_switches, moe_routing  # noqa: E402

KINDS = (  # first match wins: the specific kinds before the broad ones
    # MoE: pagedd's routing / align / combine / decode kernels, the Triton fused-MoE GEMMs
    # (moe_gemm_kernel, moe_gemm_fp8_kernel) and the grouped GEMMs (CUTLASS grouped kernels
    # name their GroupProblemShape); the experts' SiLU counts as activation.
    ("moe", re.compile(r"topk_route|moe_|fused_moe|GroupProblemShape|grouped", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|sm90_xmma|nvjet|cublas|matmul", re.I)),
    ("norm", re.compile(r"rms_norm|layer_norm", re.I)),
    ("activation", re.compile(r"silu|act_and_mul|gelu", re.I)),
    ("rotary+cache", re.compile(r"rotary_cache", re.I)),  # rotary fused with the cache write
    ("rotary", re.compile(r"rotary|rope", re.I)),
    ("cache write", re.compile(r"reshape_and_cache", re.I)),
    (
        "attention",
        re.compile(r"paged_prefill|paged_decode|paged_attention|flash|fmha|attention", re.I),
    ),
    ("sampling", re.compile(r"argmax|softmax|topk|sort|multinomial|exponential|max_kernel", re.I)),
    ("copies", re.compile(r"copy|memcpy|memset|cat|index|gather|scatter", re.I)),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--num-seqs", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None)
    parser.add_argument("--top", type=int, default=12, help="kernels listed by name")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode")
    parser.add_argument("--quantization", default=None, help="e.g. fp8 (weights)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8")
    parser.add_argument(
        "--prefill-steps", type=int, default=4, help="prefill steps profiled too (0: none)"
    )
    parser.add_argument(
        "--async-scheduling",
        choices=("off", "both"),
        default="off",
        help="both: also time steps with async scheduling, side by side",
    )
    kernel_switches.add_arguments(parser)
    moe_routing.add_arguments(parser)
    args = parser.parse_args(argv)
    switches = kernel_switches.apply(args)
    seed, spec = moe_routing.requested(args)
    routing = None
    if seed is not None or spec != "none":  # MoE models: controlled routers, stats
        from bench import moe_routing_pagedd

        routing = moe_routing_pagedd.install(seed, args.moe_router_std, spec)

    import torch

    from pydaemon.config.engine import EngineConfig
    from pydaemon.core.messages import EngineCoreRequest
    from pydaemon.engine.async_stepper import AsyncStepper
    from pydaemon.engine.engine_core import EngineCore
    from pydaemon.sampling_params import SamplingParams

    config = EngineConfig(
        model=args.model,
        load_format=args.load_format,
        device="cuda",
        max_num_seqs=args.num_seqs,
        enforce_eager=args.enforce_eager,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        async_scheduling=False,  # core.step() is synchronous; the stepper below is not
    )
    core = EngineCore(config)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=8 * args.steps + 64, ignore_eos=True)
    for i in range(args.num_seqs):
        prompt = [rng.randrange(100, 30000) for _ in range(rng.randint(64, 1024))]
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params, [], float(i)))

    def step_parts() -> tuple[float, float, float, int, int]:
        t0 = time.perf_counter()
        out = core.scheduler.schedule()
        t1 = time.perf_counter()
        core.executor.execute_model(out)
        runner_output = core.executor.sample_tokens(None).get_output()
        t2 = time.perf_counter()
        core.scheduler.update_from_output(out, runner_output)
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2, out.num_prefills, out.num_seqs

    num_prefill_steps = 0
    prefill_profile: dict | None = None
    while True:  # prefill every prompt (and warm up)
        if num_prefill_steps == 2 and args.prefill_steps > 0:
            # Full prefill steps (chunks of --max-num-batched-tokens), after two warm-up steps.
            prefill_profile = _profile_steps(step_parts, args.prefill_steps, args.top)
            num_prefill_steps += args.prefill_steps
            continue
        *_, num_prefills, _ = step_parts()
        if num_prefills == 0 and not core.scheduler.waiting:
            break
        num_prefill_steps += 1
    for _ in range(3):
        step_parts()
    torch.cuda.synchronize()

    phases: dict[str, list[float]] = {"schedule": [], "execute_model": [], "update": []}
    walls: list[float] = []
    batch_sizes: list[int] = []
    for _ in range(args.steps):
        t = time.perf_counter()
        s, e, u, _, num_seqs = step_parts()
        walls.append(time.perf_counter() - t)
        phases["schedule"].append(s)
        phases["execute_model"].append(e)
        phases["update"].append(u)
        batch_sizes.append(num_seqs)

    if routing is not None:
        routing.reset()
    profiled = _profile_steps(step_parts, args.steps, args.top)
    n = args.steps
    gpu_ms = profiled["gpu_kernel_ms_per_step"]
    result = {
        "model": args.model,
        "gpu": torch.cuda.get_device_name(),
        "num_seqs": args.num_seqs,
        "batch_size_median": statistics.median(batch_sizes),
        "prefill_steps": num_prefill_steps,
        "steps_profiled": n,
        "step_wall_ms_median": statistics.median(walls) * 1e3,
        "host_ms_median": {k: statistics.median(v) * 1e3 for k, v in phases.items()},
        "profiled_step_wall_ms": profiled["step_wall_ms"],
        "gpu_kernel_ms_per_step": gpu_ms,
        "gpu_busy_fraction": gpu_ms / profiled["step_wall_ms"],
        "kernel_launches_per_step": profiled["launches_per_step"],
        "gpu_ms_per_step_by_kind": profiled["gpu_ms_per_step_by_kind"],
        "top_kernels_ms_per_step": profiled["top_kernels_ms_per_step"],
        "kernel_switches": switches,
    }
    if routing is not None:
        raw = routing.read()
        summary = moe_routing.summarize(raw) if raw else {"note": "no MoE layer ran"}
        result["moe_routing"] = {**moe_routing.settings(args), "profiled_steps": summary}
        print(f"routing of the profiled steps: {moe_routing.describe(summary)}")
    print(f"decode step at batch {result['batch_size_median']:.0f}, median of {n} steps")
    print(f"  wall per step            {result['step_wall_ms_median']:8.2f} ms")
    for k, v in result["host_ms_median"].items():
        print(f"    {k:22s} {v:8.2f} ms")
    print(f"  GPU kernels per step     {gpu_ms:8.2f} ms ({result['gpu_busy_fraction']:.0%} busy)")
    print(f"  launches per step        {result['kernel_launches_per_step']:8.0f}")
    for k, v in result["gpu_ms_per_step_by_kind"].items():
        print(f"    {k:22s} {v:8.3f} ms")
    print("  top kernels:")
    for k, v in result["top_kernels_ms_per_step"].items():
        print(f"    {v:8.3f} ms  {k[:90]}")
    if prefill_profile is not None:
        result["prefill"] = prefill_profile
        print(f"prefill step (token budget), mean of {args.prefill_steps} steps")
        print(f"  wall per step            {prefill_profile['step_wall_ms']:8.2f} ms")
        print(f"  GPU kernels per step     {prefill_profile['gpu_kernel_ms_per_step']:8.2f} ms")
        for k, v in prefill_profile["gpu_ms_per_step_by_kind"].items():
            print(f"    {k:22s} {v:8.3f} ms")
        for k, v in prefill_profile["top_kernels_ms_per_step"].items():
            print(f"    {v:8.3f} ms  {k[:90]}")
    if args.async_scheduling == "both":
        stepper = AsyncStepper(core.scheduler, core.executor, core.structured_outputs)
        result["async"] = _time_async(core, stepper, args.steps)
        sync_ms, async_ms = _time_sync_again(step_parts, args.steps), result["async"]["wall_ms"]
        result["async"]["sync_wall_ms_same_run"] = sync_ms
        print(f"  async scheduling: {async_ms:8.2f} ms per step (sync, same run: {sync_ms:.2f} ms)")
        print(f"    sync / async wall      {sync_ms / async_ms:8.2f}x")
        print(f"    GPU busy, async        {result['async']['gpu_busy_fraction']:8.0%}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    core.shutdown()
    return 0


def _profile_steps(step_parts, num_steps: int, top: int) -> dict:
    """GPU kernel time per step by kind over ``num_steps`` steps run under the profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(num_steps):
            step_parts()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    per_kind: dict[str, float] = {}
    per_name: dict[str, float] = {}
    launches = 0
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", 0.0) or 0.0
        if event.device_type.name != "CUDA" or device_us <= 0:
            continue
        launches += event.count
        per_kind[kind_of(event.key)] = per_kind.get(kind_of(event.key), 0.0) + device_us
        per_name[event.key] = per_name.get(event.key, 0.0) + device_us
    return {
        "steps": num_steps,
        "step_wall_ms": wall * 1e3 / num_steps,
        "launches_per_step": launches / num_steps,
        "gpu_kernel_ms_per_step": sum(per_kind.values()) / 1e3 / num_steps,
        "gpu_ms_per_step_by_kind": {
            k: v / 1e3 / num_steps for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1])
        },
        "top_kernels_ms_per_step": {
            k[:120]: v / 1e3 / num_steps
            for k, v in sorted(per_name.items(), key=lambda kv: -kv[1])[:top]
        },
    }


def _time_async(core, stepper, num_steps: int) -> dict:
    """Median wall of ``num_steps`` async steps (after warm-up), and the GPU's busy share."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        stepper.step()
    walls = []
    for _ in range(num_steps):
        t = time.perf_counter()
        stepper.step()
        walls.append(time.perf_counter() - t)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(num_steps):
            stepper.step()
        stepper.finish_in_flight()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / num_steps
    gpu_s = (
        sum(
            (getattr(e, "device_time_total", 0.0) or 0.0)
            for e in prof.key_averages()
            if e.device_type.name == "CUDA"
        )
        / 1e6
        / num_steps
    )
    return {
        "wall_ms": statistics.median(walls) * 1e3,
        "profiled_step_wall_ms": wall * 1e3,
        "gpu_kernel_ms_per_step": gpu_s * 1e3,
        "gpu_busy_fraction": gpu_s / wall,
        "overlapped_steps": stepper.num_overlapped_steps,
        "sync_steps": stepper.num_sync_steps,
    }


def _time_sync_again(step_parts, num_steps: int) -> float:
    """Median wall of synchronous steps right after the async block (same batch state)."""
    walls = []
    for _ in range(num_steps):
        t = time.perf_counter()
        step_parts()
        walls.append(time.perf_counter() - t)
    return statistics.median(walls) * 1e3


if __name__ == "__main__":
    raise SystemExit(main())
