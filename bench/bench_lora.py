"""Multi-LoRA serving on the Llama-3-8B shape (dummy weights, random rank-16 adapters on every
projection): W1 with its requests spread round-robin over N adapters, against the base model's
W1, and TPOT at batch 1 with an adapter against without.

    PYTHONPATH=. python bench/bench_lora.py --mode w1 --adapters 0,8,32,128 --max-loras 32 \\
        --out bench/results/lora_w1_h200_<date>.json
    PYTHONPATH=. python bench/bench_lora.py --mode tpot --out bench/results/lora_tpot_<date>.json
    PYTHONPATH=. python bench/bench_lora.py --mode w1 --backend vllm --adapters 0,8,32,128
    PYTHONPATH=. python bench/bench_lora.py --model demo --device cpu --mode w1 \\
        --adapters 0,2 --num-requests 8 --output-len 8      # a smoke run anywhere

W1 (bench/README.md): 512 requests, 64..1024 prompt tokens, 256 output tokens, greedy, EOS ignored;
request i runs with adapter ``i % N`` (N = 0: LoRA off, the base model's figure); every adapter
is read into host memory by an untimed one-token request first (both backends). Each N runs
in its own process (the whole GPU each); ``--max-loras`` adapters fit in a batch, so with
N > max-loras requests of other adapters wait for a slot (as in vLLM). TPOT: one request, a
``--prompt-len`` prompt, ``--output-len`` tokens, base engine and LoRA engine side by side in one
process, runs alternating; TPOT = (latency - TTFT) / (output tokens - 1). ``--backend vllm``
runs the same W1 through vLLM (``enable_lora``, the same adapters and token ids).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import kernel_switches  # noqa: E402
from bench.loadgen_env import environment, write_json  # noqa: E402
from bench.lora_adapters import write_adapters  # noqa: E402
from bench.throughput_models import write_model_config  # noqa: E402
from bench.workloads import w1  # noqa: E402
from pydaemon.generate_request import GenerateRequest


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_lora", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--mode", choices=("w1", "tpot"), default="w1")
    p.add_argument("--backend", choices=("pagedd", "vllm"), default="pagedd")
    p.add_argument("--model", default=None, help="model dir (default: llama3-8b config, dummy)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--adapters", default="0,8,32,128", help="w1: adapter counts N, comma-separated")
    p.add_argument("--max-loras", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapter-dir", default=None, help="where adapters go (default: a temp dir)")
    p.add_argument("--num-requests", type=int, default=512)
    p.add_argument("--output-len", type=int, default=None, help="default: 256 (w1), 128 (tpot)")
    p.add_argument("--prompt-len", type=int, default=1024, help="tpot: prompt tokens")
    p.add_argument("--runs", type=int, default=5, help="tpot: runs per engine, alternating")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # child: N
    p.add_argument("--out", default=None, help="JSON file")
    kernel_switches.add_arguments(p)
    return p


def _prepare(args) -> list[Path]:
    if args.model is None:
        args.model = str(write_model_config("llama3-8b"))
    if args.model == "demo":
        from pydaemon.model_loader.demo_model import demo_model_dir

        args.model = str(demo_model_dir())
    counts = [int(n) for n in args.adapters.split(",")] if args.mode == "w1" else [1]
    args.adapter_dir = args.adapter_dir or tempfile.mkdtemp(prefix="pagedd-loras-")
    return write_adapters(args.model, args.adapter_dir, max(counts), args.rank)


def _engine_kwargs(args, num_adapters: int) -> dict:
    kw = dict(device=args.device, dtype=args.dtype, seed=0, enforce_eager=args.enforce_eager)
    if (Path(args.model) / "model.safetensors").exists() is False:
        kw["load_format"] = "dummy"
    if num_adapters:
        kw.update(enable_lora=True, max_loras=args.max_loras,
                  max_lora_rank=args.rank, max_cpu_loras=max(num_adapters, args.max_loras))  # fmt: skip
    return kw


def run_w1(args, num_adapters: int, paths: list[Path]) -> dict:
    """One W1 run (this process) with requests spread over ``num_adapters`` adapters."""
    requests = w1(args.num_requests, args.output_len or 256)
    prompts = [r.prompt for r in requests]
    if args.backend == "vllm":
        return _run_w1_vllm(args, num_adapters, paths, requests)
    from pydaemon import LLM, LoRARequest, SamplingParams

    llm = LLM(args.model, **_engine_kwargs(args, num_adapters))
    llm.engine.warmup()
    loras = [LoRARequest(f"adapter-{n}", n + 1, str(paths[n])) for n in range(num_adapters)]
    per_request = [loras[i % num_adapters] for i in range(len(prompts))] if loras else None
    if loras:  # untimed: every adapter read from disk into host memory (as --preload does)
        one = SamplingParams(temperature=0.0, max_tokens=1)
        llm.generate(prompt_token_ids=[[100] * 4] * len(loras), sampling_params=one,
                     lora_request=loras, use_tqdm=False)  # fmt: skip
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
              for r in requests]  # fmt: skip
    start = time.perf_counter()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params,
                           lora_request=per_request, use_tqdm=False)  # fmt: skip
    wall = time.perf_counter() - start
    stats = llm.engine.get_stats()
    llm.engine.shutdown()
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    return _w1_figures(num_adapters, wall, num_out, prompts, stats.num_preemptions)


def _run_w1_vllm(args, num_adapters: int, paths: list[Path], requests) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    kw = {}
    if num_adapters:
        kw = dict(enable_lora=True, max_loras=args.max_loras,
                  max_lora_rank=args.rank, max_cpu_loras=max(num_adapters, args.max_loras))  # fmt: skip
    llm = LLM(args.model, load_format="dummy", skip_tokenizer_init=True, dtype=args.dtype,
              seed=0, **kw)  # fmt: skip
    loras = [LoRARequest(f"adapter-{n}", n + 1, str(paths[n])) for n in range(num_adapters)]
    prompts = [TokensPrompt(prompt_token_ids=r.prompt) for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True,
                             detokenize=False) for r in requests]  # fmt: skip
    per_request = [loras[i % num_adapters] for i in range(len(prompts))] if loras else None
    if loras:  # untimed, as for pagedd: every adapter in the CPU cache first
        one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
        llm.generate([TokensPrompt(prompt_token_ids=[100] * 4)] * len(loras), one,
                     lora_request=loras, use_tqdm=False)  # fmt: skip
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=per_request, use_tqdm=False)
    wall = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    return _w1_figures(num_adapters, wall, num_out, [r.prompt for r in requests], None)


def _w1_figures(num_adapters, wall, num_out, prompts, preemptions) -> dict:
    num_prompt = sum(len(p) for p in prompts)
    return {
        "num_adapters": num_adapters,
        "wall_s": wall,
        "num_output_tokens": num_out,
        "output_throughput": num_out / wall,
        "total_token_throughput": (num_out + num_prompt) / wall,
        "num_preemptions": preemptions,
    }


def run_tpot(args, paths: list[Path]) -> dict:
    """Batch-1 TPOT: the base engine (LoRA off), the LoRA engine without and with an adapter."""
    import random

    from pydaemon import LLM, LoRARequest, SamplingParams

    common = dict(num_kv_blocks=512, max_num_seqs=256, enable_prefix_caching=False,
                  swap_space=0.5)  # fmt: skip
    base = LLM(args.model, **_engine_kwargs(args, 0), **common)
    lora = LLM(args.model, **_engine_kwargs(args, 1), **common)
    adapter = LoRARequest("adapter-0", 1, str(paths[0]))
    cases = {"base": (base, None), "lora_engine_no_adapter": (lora, None),
             "lora_engine_adapter": (lora, adapter)}  # fmt: skip
    vocab = base.engine.model_config.vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(100, min(30000, vocab)) for _ in range(args.prompt_len)]
    output_len = args.output_len or 128

    def once(llm, lora_request, n: int) -> dict:
        engine = llm.engine
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        engine.add_request(GenerateRequest("tpot", list(prompt), params, lora_request=lora_request))
        times = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                times += [time.perf_counter()] * (
                    len(out.outputs[0].token_ids) if out.outputs else 0
                )
        ttft = times[0] - start
        return {"ttft_ms": ttft * 1e3, "tpot_ms": (times[-1] - times[0]) / (len(times) - 1) * 1e3}

    for llm, lora_request in cases.values():
        once(llm, lora_request, 8)  # warm-up
    runs: dict[str, list[dict]] = {name: [] for name in cases}
    for _ in range(args.runs):
        for name, (llm, lora_request) in cases.items():
            runs[name].append(once(llm, lora_request, output_len))
    result = {name: {k: statistics.median(r[k] for r in rs) for k in ("ttft_ms", "tpot_ms")}
              for name, rs in runs.items()}  # fmt: skip
    base_tpot = result["base"]["tpot_ms"]
    for name in result:
        result[name]["tpot_over_base"] = result[name]["tpot_ms"] / base_tpot
    return {"tpot": result, "runs": runs, "prompt_len": args.prompt_len, "output_len": output_len}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    switches = kernel_switches.apply(args)  # the children get the same flags
    paths = _prepare(args)
    if args.one is not None:  # a child: one W1 run, JSON on stdout's last line
        print(json.dumps(run_w1(args, args.one, paths)))
        return 0
    report = {"meta": {**environment(["bench/bench_lora.py", *argv]), "benchmark": "bench_lora"},
              "backend": args.backend, "model": args.model, "rank": args.rank,
              "max_loras": args.max_loras, "kernel_switches": switches}  # fmt: skip
    if args.mode == "tpot":
        report.update(run_tpot(args, paths))
        print(json.dumps(report["tpot"], indent=2))
    else:
        rows = []
        for n in [int(x) for x in args.adapters.split(",")]:
            child = [sys.executable, __file__, *argv, "--one", str(n), "--model", args.model,
                     "--adapter-dir", args.adapter_dir]  # fmt: skip
            done = subprocess.run(child, check=True, capture_output=True, text=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            base = rows[0]["output_throughput"] if rows[0]["num_adapters"] == 0 else None
            row = rows[-1]
            ratio = "" if base is None else f"  {row['output_throughput'] / base:.3f}x base"
            print(f"{args.backend} N={n:<4} wall {row['wall_s']:8.2f} s  "
                  f"{row['output_throughput']:9.1f} out tok/s{ratio}", flush=True)  # fmt: skip
        report["w1"] = rows
    if args.out:
        write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
