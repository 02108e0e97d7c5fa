"""The vLLM backend of throughput.py: the same workload through vLLM's offline ``LLM.generate``.

vLLM is the peer engine of bench/README.md, installed on the GPU machine outside its site-packages
(``PYTHONPATH=VLLM_SITE``; run with ``VLLM_USE_FLASHINFER_SAMPLER=0``). It gets the workload's
token ids as they are (``skip_tokenizer_init=True``: no tokenizer is needed, and the model
directory may hold only config.json with ``--load-format dummy``), greedy, EOS ignored, no
detokenization. Everything not given on the command line is vLLM's own default (its step
budget, max_num_seqs, torch.compile, CUDA graphs, prefix caching): the peer as shipped.

With ``--profile`` the engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
so that torch.profiler sees its kernels: that run's wall time is not vLLM's default set-up.

The figures have the pagedd backend's keys; those vLLM does not expose offline (peak KV blocks
in use, KV waste, preemptions, steps) are None, and the table prints them as "-".
"""

from __future__ import annotations

import os
import time

from bench import moe_routing
from bench.gpu_breakdown import Profiled
from bench.workloads import WorkloadRequest

# Token ids of the untimed warm-up prompts: outside W1's [100, 30000), so that the warm-up
# leaves no prefix-cache entry that a W1 prompt could hit (the cache is reset anyway).
_WARMUP_TOKEN = 30001


def engine_kwargs(model: str, args) -> dict:
    """vLLM ``LLM(...)`` arguments from throughput.py's flags (unset flags: vLLM's defaults)."""
    kwargs: dict = {
        "model": model,
        "skip_tokenizer_init": True,
        "seed": args.seed,
        "enable_prefix_caching": not args.no_prefix_caching,
        "enforce_eager": args.enforce_eager,
    }
    if args.load_format:
        kwargs["load_format"] = args.load_format
    if args.dtype and args.dtype != "auto":
        kwargs["dtype"] = args.dtype
    for key in ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                "gpu_memory_utilization", "tensor_parallel_size", "block_size"):  # fmt: skip
        if getattr(args, key, None) is not None:
            kwargs[key] = getattr(args, key)
    if args.kv_cache_dtype and args.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    if args.quantization is not None:
        if args.quantization != "fp8":
            raise ValueError(
                f"the vllm backend takes --quantization fp8 only (got {args.quantization})"
            )
        kwargs["quantization"] = "fp8"
    return kwargs


def _token_prompts(requests: list[WorkloadRequest]) -> list[dict]:
    if any(r.is_text for r in requests):
        raise ValueError("the vllm backend runs token-id workloads only (it has no tokenizer)")
    return [{"prompt_token_ids": list(r.prompt)} for r in requests]


def _sampling(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          detokenize=False)  # fmt: skip


def _config_summary(llm) -> dict:
    """vLLM's effective settings, as far as its front end knows them."""
    import vllm

    config = getattr(llm.llm_engine, "vllm_config", None)
    sched = getattr(config, "scheduler_config", None)
    cache = getattr(config, "cache_config", None)
    model = getattr(config, "model_config", None)
    compilation = getattr(config, "compilation_config", None)
    return {
        "name": "vllm",
        "version": vllm.__version__,
        "max_num_seqs": getattr(sched, "max_num_seqs", None),
        "max_num_batched_tokens": getattr(sched, "max_num_batched_tokens", None),
        "block_size": getattr(cache, "block_size", None),
        "kv_cache_dtype": str(getattr(cache, "cache_dtype", None)),
        "enable_prefix_caching": getattr(cache, "enable_prefix_caching", None),
        "max_model_len": getattr(model, "max_model_len", None),
        "quantization": getattr(model, "quantization", None),
        "enforce_eager": getattr(model, "enforce_eager", None),
        "compilation_mode": str(getattr(compilation, "mode", getattr(compilation, "level", None))),
    }


def run_vllm(
    model: str, requests: list[WorkloadRequest], args, vocab_size: int | None = None
) -> dict:
    profile = getattr(args, "profile", False)
    if profile:  # the engine core in this process, where the profiler sees its kernels
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    routing_env = _routing_plugin(args)  # before vLLM starts its processes
    from vllm import LLM

    prompts = _token_prompts(requests)
    t_load = time.perf_counter()
    llm = LLM(**engine_kwargs(model, args))
    warmup = [{"prompt_token_ids": [_WARMUP_TOKEN + i] * 32} for i in range(8)]
    llm.generate(warmup, _sampling(4), use_tqdm=False)  # untimed, as pagedd's engine.warmup()
    llm.reset_prefix_cache()
    load_s = time.perf_counter() - t_load
    params = [_sampling(r.output_len) for r in requests]
    routing, routing_error = None, None
    if routing_env:  # the plugin answers in the engine's processes, or the run goes on without
        try:
            llm.collective_rpc("pagedd_routing", args=("reset",))
            routing = _routing_phases(llm)
        except Exception as exc:  # e.g. vLLM never loaded the plugin there
            routing_error = f"the routing plugin did not answer: {exc!r}"
    if routing is not None:
        routing.start()
    with Profiled(profile) as profiled:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
        wall_s = time.perf_counter() - start
    if routing is not None:
        routing.finish("workload")
    num_output = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    config = getattr(llm.llm_engine, "vllm_config", None)
    figures = {
        "wall_s": wall_s,
        "load_s": load_s,
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_output,
        "num_steps": None,
        "async_scheduling": getattr(
            getattr(config, "scheduler_config", None), "async_scheduling", None
        ),  # fmt: skip
        "peak_kv_blocks_used": None,
        "num_gpu_blocks": getattr(getattr(config, "cache_config", None), "num_gpu_blocks", None),
        "block_size": getattr(getattr(config, "cache_config", None), "block_size", None),
        "kv_waste": {},
        "num_preemptions": None,
        "mean_ttft_s": None,
        "engine": _config_summary(llm),
    }
    if profiled.result is not None:
        figures["gpu_breakdown"] = profiled.result
    if getattr(args, "tpot_batch1", 0):
        from bench.tpot_generate import measure_tpot_batch1, token_range_for

        def generate_one(ids: list[int], max_tokens: int) -> int:
            out = llm.generate([{"prompt_token_ids": ids}], _sampling(max_tokens), use_tqdm=False)
            return len(out[0].outputs[0].token_ids)

        if routing is not None:
            routing.start()
        figures["tpot_batch1"] = measure_tpot_batch1(
            generate_one, args.tpot_batch1, prompt_len=args.tpot_prompt_len,
            output_len=args.tpot_output_len, token_range=token_range_for(vocab_size),
        )  # fmt: skip
        if routing is not None:
            routing.finish("tpot_batch1")
    if getattr(args, "tpot_batch", 0):
        from bench.tpot_generate import measure_tpot_batch, token_range_for

        def generate_batch(prompts: list[list[int]], max_tokens: int) -> list[int]:
            inputs = [{"prompt_token_ids": ids} for ids in prompts]
            outs = llm.generate(inputs, _sampling(max_tokens), use_tqdm=False)
            return [len(o.outputs[0].token_ids) for o in outs]

        if routing is not None:
            routing.start()
        figures["tpot_batch"] = measure_tpot_batch(
            generate_batch, args.tpot_batch, args.tpot_batch_size,
            prompt_len=args.tpot_prompt_len, output_len=args.tpot_output_len,
            token_range=token_range_for(vocab_size),
        )  # fmt: skip
        if routing is not None:
            routing.finish(f"tpot_batch{args.tpot_batch_size}")
    if routing is not None:
        hooks = llm.collective_rpc("pagedd_routing", args=("reset",))[0]
        figures["moe_routing"] = {**moe_routing.settings(args), **routing.results, **hooks}
    elif routing_error is not None:
        figures["moe_routing"] = {**moe_routing.settings(args), "error": routing_error}
    return figures


def _routing_plugin(args) -> bool:
    """bench/vllm_routing_plugin.py as a vLLM general plugin in every vLLM process, when
    --moe-router-seed or --routing-stats ask: its dist-info in a temp dir on sys.path and
    PYTHONPATH (inherited by the engine core), its settings in the environment. (An
    environment that sets VLLM_PLUGINS must name pagedd_bench_moe_routing in it.)"""
    seed, spec = moe_routing.requested(args)
    if seed is None and spec == "none":
        return False
    import sys
    import tempfile

    from bench.vllm_routing_plugin import write_plugin_dist

    where = tempfile.mkdtemp(prefix="pagedd-vllm-plugin-")
    write_plugin_dist(where)
    sys.path.insert(0, where)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (where, os.environ.get("PYTHONPATH")) if p
    )
    if seed is not None:
        os.environ[moe_routing.ENV_SEED] = str(seed)
    if getattr(args, "moe_router_std", None) is not None:
        os.environ[moe_routing.ENV_STD] = str(args.moe_router_std)
    os.environ[moe_routing.ENV_LAYERS] = spec
    return True


def _routing_phases(llm) -> moe_routing.Phases:
    def reset() -> None:
        llm.collective_rpc("pagedd_routing", args=("reset",))

    def read() -> dict | None:
        return llm.collective_rpc("pagedd_routing", args=("read",))[0]["raw"]

    return moe_routing.Phases(reset, read)
