"""The pagedd backend of throughput.py: the workload through ``LLM.generate``, in process (and,
on request, TPOT at batch 1 on the same engine and a GPU profile of the run)."""

from __future__ import annotations

import dataclasses
import statistics
import time

from bench import kernel_switches, moe_routing
from bench.workloads import WorkloadRequest

# --json-schema-workload: a list of records with free-text fields, so that 256 greedy tokens
# of a dummy model stay inside the grammar (a finished grammar leaves the row unconstrained).
WORKLOAD_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "active": {"type": "boolean"},
        },
        "required": ["id", "name", "tags", "active"],
        "additionalProperties": False,
    },
}


class StepStats:
    """Wraps ``engine.step`` to read the KV blocks in use and the KV waste after every step
    (two calls into the C++ block manager per step: no device work)."""

    def __init__(self, engine) -> None:
        from pydaemon import _core

        self.engine, self.gpu = engine, _core.Device.GPU
        self.peak_used = 0
        self.waste_at_peak = 0
        self.waste_fractions: list[float] = []
        self.num_steps = 0
        self.step_walls: list[float] = []  # seconds, each engine.step call (host side)
        self._step = engine.step
        engine.step = self.step

    def step(self):
        start = time.perf_counter()
        outputs = self._step()
        self.step_walls.append(time.perf_counter() - start)
        bm = self.engine.block_manager
        used = bm.num_used_blocks(self.gpu)
        waste = bm.kv_waste()
        self.num_steps += 1
        if used:
            self.waste_fractions.append(waste / (used * self.engine.config.block_size))
        if used >= self.peak_used:
            self.peak_used, self.waste_at_peak = used, waste
        return outputs

    def restore(self) -> None:
        self.engine.step = self._step

    def slowest_steps(self, n: int = 10) -> list[tuple[int, float]]:
        """(step index, ms) of the n longest engine.step calls: host stalls show here."""
        order = sorted(range(len(self.step_walls)), key=lambda i: -self.step_walls[i])[:n]
        return [(i, self.step_walls[i] * 1e3) for i in order]


class HostStalls:
    """Two suspects of long host pauses in a run, measured: Python's garbage collections (by
    generation: count, total and longest, from gc.callbacks) and the CUDA caching allocator
    freeing its cache to retry an allocation (num_alloc_retries: a device sync and cudaFree)."""

    def __init__(self) -> None:
        import gc

        self.gc = gc
        self.by_gen = {g: [0, 0.0, 0.0] for g in range(3)}
        self._t0 = 0.0
        self._alloc_before = self._allocator()

    def __enter__(self) -> HostStalls:
        self.gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        self.gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        entry = self.by_gen[info["generation"]]
        dt = time.perf_counter() - self._t0
        entry[0] += 1
        entry[1] += dt
        entry[2] = max(entry[2], dt)

    @staticmethod
    def _allocator() -> dict:
        import torch

        if not torch.cuda.is_available():
            return {}
        stats = torch.cuda.memory_stats()
        keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
        return {k: stats.get(k, 0) for k in keys}

    def figures(self) -> dict:
        after = self._allocator()
        return {
            "gc_by_generation": {
                f"gen{g}": {"count": c, "total_ms": t * 1e3, "max_ms": m * 1e3}
                for g, (c, t, m) in self.by_gen.items()
            },
            "cuda_allocator": {k: after[k] - self._alloc_before.get(k, 0) for k in after},
        }


def engine_kwargs(args) -> dict:
    keys = ("device", "dtype", "block_size", "num_kv_blocks", "gpu_memory_utilization",
            "max_num_seqs", "max_num_batched_tokens", "max_model_len", "preemption_mode",
            "load_format", "seed", "tensor_parallel_size", "kv_cache_dtype",
            "async_scheduling", "quantization", "distributed_executor_backend",
            "kv_offloading_size")  # fmt: skip
    kwargs = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    kwargs["enable_prefix_caching"] = not args.no_prefix_caching
    kwargs["enforce_eager"] = args.enforce_eager
    return kwargs


def run_pagedd(
    model: str, requests: list[WorkloadRequest], args, vocab_size: int | None = None
) -> dict:
    from bench.gpu_breakdown import Profiled
    from pydaemon import LLM, SamplingParams

    switches = kernel_switches.apply(args)
    routing = _install_routing(args)
    t_load = time.perf_counter()
    llm = LLM(model=model, **engine_kwargs(args))
    engine = llm.engine
    engine.warmup()  # as the daemon does before serving; not timed
    load_s = time.perf_counter() - t_load
    constraint = None
    if getattr(args, "json_schema_workload", False):
        from pydaemon.sampling_params import StructuredOutputsParams

        constraint = StructuredOutputsParams(json=WORKLOAD_SCHEMA)
        warm = SamplingParams(max_tokens=2, structured_outputs=constraint)
        llm.generate([requests[0].prompt], warm, use_tqdm=False)  # compile cache warm
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=r.output_len,
            ignore_eos=True,
            structured_outputs=constraint,
        )
        for r in requests
    ]
    matchers = engine.core.structured_outputs.matchers
    mask_before = None if matchers is None else dataclasses.replace(matchers.stats)
    stats = StepStats(engine)
    before = engine.get_stats()
    if routing is not None:
        routing.start()
    with Profiled(getattr(args, "profile", False)) as profiled, HostStalls() as stalls:
        start = time.perf_counter()
        outputs = llm.generate([r.prompt for r in requests], params, use_tqdm=not args.no_progress)
        wall_s = time.perf_counter() - start
    stats.restore()
    after = engine.get_stats()
    if routing is not None:
        routing.finish("workload")
    tpot = tpot_b = None
    if getattr(args, "tpot_batch1", 0):
        if routing is not None:
            routing.start()
        tpot = _tpot_batch1(llm, args, vocab_size)
        if routing is not None:
            routing.finish("tpot_batch1")
    if getattr(args, "tpot_batch", 0):
        if routing is not None:
            routing.start()
        tpot_b = _tpot_batch(llm, args)
        if routing is not None:
            routing.finish(f"tpot_batch{args.tpot_batch_size}")
    engine.shutdown()  # stops tensor-parallel workers, if any
    num_output = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs
             if o.metrics is not None and o.metrics.first_token_time is not None]  # fmt: skip
    block_size = engine.config.block_size
    figures = {
        "wall_s": wall_s,
        "load_s": load_s,
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_output,
        "num_steps": stats.num_steps,
        "async_scheduling": engine.core.async_stepper is not None,
        "peak_kv_blocks_used": engine.peak_used_blocks,
        "num_gpu_blocks": after.num_gpu_blocks,
        "block_size": block_size,
        "kv_waste": {
            "slots_at_peak": stats.waste_at_peak,
            "fraction_at_peak": stats.waste_at_peak / max(1, stats.peak_used * block_size),
            "mean_fraction": statistics.fmean(stats.waste_fractions)
            if stats.waste_fractions
            else 0.0,
        },
        "num_preemptions": after.num_preemptions - before.num_preemptions,
        "num_swapped_out_blocks": after.num_swapped_out_blocks - before.num_swapped_out_blocks,
        "prefix_cache_hit_tokens": after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens,
        "mean_ttft_s": statistics.fmean(ttfts) if ttfts else None,
        "engine": {
            "max_model_len": engine.max_model_len,
            "model": engine.model_name,
            **{k: v for k, v in engine.config.__dict__.items() if k != "model"},
        },  # fmt: skip
        "kernel_switches": switches,
        "host_stalls": {"slowest_steps_ms": stats.slowest_steps(), **stalls.figures()},
    }
    if mask_before is not None:
        figures["structured_outputs"] = _mask_figures(mask_before, matchers.stats)
    if tpot is not None:
        figures["tpot_batch1"] = tpot
    if tpot_b is not None:
        figures["tpot_batch"] = tpot_b
    if routing is not None:
        figures["moe_routing"] = {**moe_routing.settings(args), **routing.results}
    if profiled.result is not None:
        figures["gpu_breakdown"] = profiled.result
    return figures


def _install_routing(args) -> moe_routing.Phases | None:
    """bench/moe_routing_pagedd.py's hooks when --moe-router-seed or --routing-stats ask."""
    seed, spec = moe_routing.requested(args)
    if seed is None and spec == "none":
        return None
    from bench import moe_routing_pagedd

    hooks = moe_routing_pagedd.install(seed, getattr(args, "moe_router_std", None), spec)
    return moe_routing.Phases(hooks.reset, hooks.read)


def _mask_figures(before, after) -> dict:
    """Host time of the grammar masks per step (the device part is a few batched ops)."""
    num_steps = max(1, after.num_steps - before.num_steps)
    return {
        "schema": WORKLOAD_SCHEMA,
        "num_masked_steps": after.num_steps - before.num_steps,
        "mean_constrained_rows_per_step": (after.num_rows - before.num_rows) / num_steps,
        "fill_ms_per_step": (after.fill_s - before.fill_s) * 1e3 / num_steps,
    }


def _tpot_batch1(llm, args, vocab_size: int | None) -> dict:
    """TPOT at batch 1 on this engine (bench/tpot_generate.py, as for the vLLM backend)."""
    from bench.tpot_generate import measure_tpot_batch1, token_range_for
    from pydaemon import SamplingParams

    def generate_one(ids: list[int], max_tokens: int) -> int:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        (out,) = llm.generate([ids], params, use_tqdm=False)
        return len(out.outputs[0].token_ids)

    vocab_size = vocab_size or llm.engine.model_config.vocab_size
    return measure_tpot_batch1(
        generate_one, args.tpot_batch1, prompt_len=args.tpot_prompt_len,
        output_len=args.tpot_output_len, token_range=token_range_for(vocab_size),
    )  # fmt: skip


def _tpot_batch(llm, args) -> dict:
    """TPOT at batch --tpot-batch-size on this engine (bench/tpot_generate.py)."""
    from bench.tpot_generate import measure_tpot_batch, token_range_for
    from pydaemon import SamplingParams

    def generate_batch(prompts: list[list[int]], max_tokens: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outs]

    return measure_tpot_batch(
        generate_batch, args.tpot_batch, args.tpot_batch_size, prompt_len=args.tpot_prompt_len,
        output_len=args.tpot_output_len,
        token_range=token_range_for(llm.engine.model_config.vocab_size),
    )  # fmt: skip
