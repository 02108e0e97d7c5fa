"""TPOT at a fixed batch size (1, 64, ...): N requests with ``--prompt-len`` random token ids,
greedy, EOS ignored, ``--output-len`` tokens each, all submitted at once to one in-process
engine and stepped to the end. Reported per batch size (medians over ``--runs``): TTFT of the
batch (all prompts prefilled), TPOT = (last token - first token) / (output tokens - 1) per
request, the median decode step while all N requests decode, and output tokens per second
of the decode phase. Meant for the MoE shapes (bench/throughput_models.py), any model works.

    python bench/throughput_models.py qwen3-30b-a3b /tmp/qwen3-30b-a3b
    PYTHONPATH=. python bench/tpot_batch.py --model /tmp/qwen3-30b-a3b --batch-sizes 1,64 \\
        [--quantization fp8|awq|gptq|compressed-tensors|mxfp4] --out bench/results/tpot_qwen3_30b_a3b_h200_<date>.json
    PYTHONPATH=. python bench/tpot_batch.py --model demo --device cpu --batch-sizes 1,4 \\
        --prompt-len 16 --output-len 4 --runs 1
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.loadgen_env import environment, write_json  # noqa: E402
from pydaemon.generate_request import GenerateRequest


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tpot_batch", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model directory, or 'demo'")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default=None,
                   choices=("fp8", "fp8_emulated", "awq", "gptq", "compressed-tensors", "mxfp4"))  # fmt: skip
    p.add_argument("--batch-sizes", default="1,64", help="comma-separated")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--runs", type=int, default=3, help="per batch size")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: profiled")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--out", default=None, help="JSON file to write")
    return p


def run_batch(llm, prompts: list[list[int]], output_len: int, device: str) -> dict:
    import torch

    from pydaemon import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerateRequest(f"r{i}", list(prompt), params))
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    decode_steps: list[float] = []
    prev = None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        all_decoding = len(first) == len(prompts)
        if prev is not None and all_decoding:
            decode_steps.append(now - prev)
        prev = now
        for out in outputs:
            n = len(out.outputs[0].token_ids) if out.outputs else 0
            if n:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                count[out.request_id] = count.get(out.request_id, 0) + n
    tpots = [(last[r] - first[r]) / max(1, count[r] - 1) for r in first]
    decode_time = max(last.values()) - max(first.values())
    decode_tokens = sum(count.values()) - len(prompts)
    return {
        "ttft_ms": (max(first.values()) - start) * 1e3,
        "tpot_ms": statistics.median(tpots) * 1e3,
        "median_decode_step_ms": statistics.median(decode_steps) * 1e3 if decode_steps else 0.0,
        "decode_tokens_per_s": decode_tokens / decode_time if decode_time > 0 else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]
    if not sizes or min(sizes) < 1 or max(sizes) > args.max_num_seqs:
        print("tpot_batch: --batch-sizes must be in [1, --max-num-seqs]", file=sys.stderr)
        return 2
    from pydaemon import LLM

    kw = dict(device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              enable_prefix_caching=False, enforce_eager=args.enforce_eager, seed=0,
              max_num_batched_tokens=max(8192, args.prompt_len))  # fmt: skip
    if args.model != "demo":
        kw["load_format"] = args.load_format
    if args.quantization:
        kw["quantization"] = args.quantization
    if args.num_kv_blocks:
        kw["num_kv_blocks"] = args.num_kv_blocks
    llm = LLM(args.model, **kw)
    cfg = llm.engine.model_config
    rng = random.Random(0)
    vocab = min(30000, cfg.vocab_size)
    results = {}
    for n in sizes:
        prompts = [
            [rng.randrange(min(100, vocab // 2), vocab) for _ in range(args.prompt_len)]
            for _ in range(n)
        ]
        run_batch(llm, prompts[:1], 8, args.device)  # warm-up
        runs = [run_batch(llm, prompts, args.output_len, args.device) for _ in range(args.runs)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        results[str(n)] = {**med, "runs": runs}
        print(f"batch {n:4}: TTFT {med['ttft_ms']:9.2f} ms  TPOT {med['tpot_ms']:8.3f} ms  "
              f"step {med['median_decode_step_ms']:8.3f} ms  "
              f"{med['decode_tokens_per_s']:9.1f} tok/s")  # fmt: skip
    report = {
        "meta": {
            **environment(["bench/tpot_batch.py", *(argv or sys.argv[1:])]),
            "benchmark": "tpot_batch",
        },  # fmt: skip
        "workload": {
            "model": args.model,
            "architecture": cfg.architecture,
            "dtype": args.dtype,
            "quantization": args.quantization,
            "prompt_tokens": args.prompt_len,
            "output_tokens": args.output_len,
            "runs": args.runs,
            "cuda_graphs": not args.enforce_eager,
        },
        "results": results,
    }
    if args.out:
        write_json(Path(args.out), report)
        print(f"wrote {args.out}", file=sys.stderr)
    llm.engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
