"""W1 (offline throughput, bench/README.md) at several tensor-parallel sizes, side by side.

Each size runs in its own subprocess (one tensor-parallel group per process, and a clean GPU
for every run) on a dummy-weight model written as a bare config.json: the Llama-3-8B shape by
default, ``--shape tiny`` for a CPU smoke run. Reports wall time (first submit to last token),
output and total tokens/s, mean per-token latency (TPOT: (finish - first token) / (n - 1)),
mean TTFT, peak KV blocks in use and preemptions; writes JSON and prints a table.

    python bench/bench_tp.py --tp-sizes 1 2 --out bench/results/tp_h200x2.json
    python bench/bench_tp.py --shape tiny --device cpu --tp-sizes 1 2 --num-requests 8 --output-len 16
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    "llama3-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        rope_theta=500000.0, max_position_embeddings=8192, torch_dtype="bfloat16",
    ),
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=32000, rope_theta=10000.0,
        max_position_embeddings=2048, torch_dtype="float32",
    ),
}  # fmt: skip


def write_model_dir(shape: str, path: Path) -> Path:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **SHAPES[shape],
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def w1_prompts(num_requests: int) -> list[list[int]]:
    rng = random.Random(0)
    prompts = []
    for _ in range(num_requests):
        n = rng.randint(64, 1024)
        prompts.append([rng.randrange(100, 30000) for _ in range(n)])
    return prompts


def run_one(args: argparse.Namespace) -> dict:
    """One tensor-parallel size in this process."""
    from pydaemon import LLM, SamplingParams

    optional = {
        k: getattr(args, k)
        for k in ("max_num_seqs", "max_num_batched_tokens")
        if getattr(args, k) is not None
    }
    llm = LLM(
        args.model_dir,
        device=args.device,
        load_format="dummy",
        tensor_parallel_size=args.single,
        **optional,
    )
    llm.engine.warmup()
    prompts = w1_prompts(args.num_requests)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    wall = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_in = sum(len(p) for p in prompts)
    tpot = [
        (o.metrics.finished_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
        for o in outputs
        if len(o.outputs[0].token_ids) > 1
    ]
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    stats = llm.engine.get_stats()
    result = {
        "tensor_parallel_size": args.single,
        "num_requests": len(prompts),
        "wall_s": wall,
        "output_tokens_per_s": num_out / wall,
        "total_tokens_per_s": (num_out + num_in) / wall,
        "mean_tpot_ms": 1e3 * statistics.mean(tpot) if tpot else None,
        "mean_ttft_ms": 1e3 * statistics.mean(ttft),
        "num_gpu_blocks": stats.num_gpu_blocks,
        "peak_used_blocks": llm.engine.peak_used_blocks,
        "num_preemptions": stats.num_preemptions,
    }
    llm.engine.shutdown()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--num-requests", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: the engine's")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="JSON results file")
    parser.add_argument("--single", type=int, help=argparse.SUPPRESS)  # child: one size
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.single is not None:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return 0
    model_dir = write_model_dir(args.shape, Path(tempfile.mkdtemp()) / args.shape)
    results = []
    for tp in args.tp_sizes:
        cmd = [sys.executable, __file__, "--single", str(tp), "--model-dir", str(model_dir)]
        for flag in (
            "device",
            "num_requests",
            "output_len",
            "max_num_seqs",
            "max_num_batched_tokens",
        ):
            if getattr(args, flag) is not None:
                cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"TP={tp} run failed (exit {proc.returncode})")
        results.append(json.loads(lines[-1][len("RESULT ") :]))
    base = results[0]["wall_s"]
    print(f"W1 {args.shape}, {args.num_requests} requests x {args.output_len} tokens")
    print(
        "| TP | wall s | out tok/s | total tok/s | TPOT ms | TTFT ms | peak blocks | preempt | speed-up |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        tpot = f"{r['mean_tpot_ms']:.1f}" if r["mean_tpot_ms"] is not None else "-"
        print(
            f"| {r['tensor_parallel_size']} | {r['wall_s']:.2f} | {r['output_tokens_per_s']:.0f} | "
            f"{r['total_tokens_per_s']:.0f} | {tpot} | {r['mean_ttft_ms']:.0f} | "
            f"{r['peak_used_blocks']}/{r['num_gpu_blocks']} | {r['num_preemptions']} | "
            f"{base / r['wall_s']:.2f}x |"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"shape": args.shape, "argv": sys.argv, "date": time.strftime("%Y-%m-%d")}
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
