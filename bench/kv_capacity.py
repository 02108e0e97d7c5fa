"""KV capacity of windowed models at a real shape and memory budget, without a GPU: how many
long sequences the scheduler holds at once when sliding windows free their blocks (every
layer windowed: ``kv_window``; windowed and global layers: per-layer-group tables) against a
cache that keeps every block; or, with ``--workload w1``, how bench/README.md's W1 is admitted,
decoded and preempted at that budget (a device run's preemptions, replayed on the CPU).

The real Scheduler and block manager run every step of the workload (chunked prefill at the
step budget, decode, preemption); the model does not: each step "samples" a fixed token. The
cache has the blocks that ``--kv-gib`` GiB hold at the shape's KV bytes per block (a block of
every layer, or of one group's slots). Reported per mode: the most sequences past
``--long-at`` tokens held at once, the most sequences running (and the mean over the steps),
preemptions (and how many requests they hit), the prompt tokens computed again after a
preemption, steps, and the blocks in use at the peak.

    PYTHONPATH=. python bench/kv_capacity.py --shape mistral-7b --out /tmp/cap.json
    # W1 at the KV an H100 leaves Gemma-3-27B: the "KV cache: N blocks" of the device log
    # times the block's bytes (1.25 MiB here: 10 layer slots), e.g. 13,900 blocks
    PYTHONPATH=. python bench/kv_capacity.py --shape gemma3-27b --workload w1 --kv-gib 16.97

Defaults: 64 requests of 32,256 prompt tokens + 512 output tokens (32k each), a 16,384-token
step budget, block size 16, the KV budget an H200 leaves (``DEFAULT_KV_GIB``: 0.9 of its
139 GiB, less the bf16 weights and about 4 GiB of activations and graphs; an estimate), and
the engine's admission watermark (``EngineConfig.watermark``; the figures of 2026-12-04 were
taken with none). W1 (``--workload w1``): its 512 prompts of 64 to 1,024 tokens, 256 output
tokens each, and the engine's default step budget on a GPU (4,096 tokens).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput_models import MODEL_CONFIGS  # noqa: E402
from workloads import w1  # noqa: E402

from pydaemon.config.engine import EngineConfig  # noqa: E402
from pydaemon.config.model import ModelConfig  # noqa: E402
from pydaemon.core.kv_groups import plan_kv_groups  # noqa: E402
from pydaemon.core.request import Request, Sequence  # noqa: E402
from pydaemon.core.runner_output import ModelRunnerOutput  # noqa: E402
from pydaemon.core.sched.scheduler import Scheduler  # noqa: E402
from pydaemon.core.sched.scheduler_config import SchedulerConfig  # noqa: E402
from pydaemon.core.stop_checker import StopChecker  # noqa: E402
from pydaemon.outputs import RequestMetrics  # noqa: E402
from pydaemon.sampling_params import SamplingParams  # noqa: E402

GIB = 1 << 30
# GiB of KV an H200 leaves at gpu_memory_utilization 0.9 (125 GiB), less bf16 weights and ~4
# GiB of activations and CUDA graphs: an estimate, not a measurement.
DEFAULT_KV_GIB = {"mistral-7b": 107.0, "gemma3-27b": 70.0, "gpt-oss-20b": 82.0}


def run(shape: str, mode: str, args) -> dict:
    config = ModelConfig.from_dict(MODEL_CONFIGS[shape])
    windows = config.layer_sliding_windows
    per_layer = 2 * config.num_key_value_heads * config.head_dim * args.block_size * 2  # bf16
    groups = plan_kv_groups(windows) if mode == "freeing" else None
    all_windowed = all(w is not None for w in windows)
    kv_window = max(windows) if mode == "freeing" and all_windowed else None
    slots = groups.num_slots if groups is not None else config.num_hidden_layers
    num_blocks = int(args.kv_gib * GIB // (per_layer * slots))
    if args.workload == "w1":
        workload = [(r.prompt, r.output_len) for r in w1(args.num_requests)]
    else:
        rng = random.Random(0)
        workload = [
            ([rng.randrange(100, 30000) for _ in range(args.prompt_len)], args.output_len)
            for _ in range(args.num_requests)
        ]
    max_len = max(len(prompt) + n for prompt, n in workload)
    scheduler = Scheduler(
        SchedulerConfig(
            block_size=args.block_size,
            num_gpu_blocks=num_blocks,
            watermark=args.watermark,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.step_budget,
            max_model_len=max_len,
            preemption_mode="recompute",
            kv_window=kv_window,
            kv_groups=groups,
        )
    )
    requests = []
    for i, (prompt, output_len) in enumerate(workload):
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        request = Request(
            f"r{i}", prompt, params, set(), metrics=RequestMetrics(arrival_time=float(i))
        )
        request.stop_checker = StopChecker(params, set())
        request.seqs.append(Sequence.new(0, prompt))
        scheduler.add_request(request)
        requests.append(request)
    best_long = best_running = peak_used = steps = sum_running = 0
    start = time.perf_counter()
    while scheduler.requests:
        out = scheduler.schedule()
        steps += 1
        sampled = []
        for request in scheduler.running:
            for seq in request.seqs:
                n = out.num_scheduled_tokens.get(seq.seq_id)
                if n is not None and seq.num_computed_tokens + n == seq.num_tokens:
                    sampled.append(seq.seq_id)
        ro = ModelRunnerOutput(
            seq_ids=sampled,
            sampled_token_ids=[[1000]] * len(sampled),
            chosen_logprobs=[[-1.0]] * len(sampled),
            logprobs=[[None]] * len(sampled),
        )
        long = sum(
            seq.num_computed_tokens >= args.long_at
            for request in scheduler.running
            for seq in request.seqs
        )
        best_long = max(best_long, long)
        best_running = max(best_running, len(scheduler.running))
        sum_running += len(scheduler.running)
        peak_used = max(peak_used, scheduler.blocks.num_used_gpu_blocks())
        scheduler.update_from_output(out, ro)
    stats = scheduler.make_stats(num_waiting_elsewhere=0)
    return {
        "shape": shape,
        "workload": args.workload,
        "mode": mode,
        "tables": "per layer group" if groups else ("window" if kv_window else "one, all kept"),
        "num_groups": groups.num_groups if groups else 1,
        "kv_gib": args.kv_gib,
        "num_blocks": num_blocks,
        "block_bytes": per_layer * slots,
        "max_long_seqs_held": best_long,
        "max_running": best_running,
        "mean_running": round(sum_running / max(1, steps), 1),
        "peak_blocks_used": peak_used,
        "preemptions": stats.num_preemptions,
        "requests_preempted": sum(r.num_preemptions > 0 for r in requests),
        "recomputed_prompt_tokens": stats.num_prompt_tokens - sum(len(p) for p, _ in workload),
        "steps": steps,
        "sim_s": round(time.perf_counter() - start, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(DEFAULT_KV_GIB), default="mistral-7b")
    parser.add_argument("--kv-gib", type=float, default=None)
    parser.add_argument("--workload", choices=("long", "w1"), default="long",
                        help="long: --num-requests x (--prompt-len + --output-len); w1: "
                        "bench/README.md's W1 (its first --num-requests requests)")  # fmt: skip
    parser.add_argument("--num-requests", type=int, default=None, help="64; W1: 512")
    parser.add_argument("--prompt-len", type=int, default=32256)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--long-at", type=int, default=30000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--step-budget", type=int, default=None, help="16384; W1: 4096")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="256; W1: 512")
    parser.add_argument("--watermark", type=float, default=EngineConfig.watermark)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.kv_gib is None:
        args.kv_gib = DEFAULT_KV_GIB[args.shape]
    is_w1 = args.workload == "w1"  # W1: the engine's defaults on a GPU
    for name, long_default, w1_default in (("num_requests", 64, 512), ("step_budget", 16384, 4096),
                                           ("max_num_seqs", 256, 512)):  # fmt: skip
        if getattr(args, name) is None:
            setattr(args, name, w1_default if is_w1 else long_default)
    rows = [run(args.shape, mode, args) for mode in ("keeping", "freeing")]
    keep, free = rows
    ratio = free["max_long_seqs_held"] / max(1, keep["max_long_seqs_held"])
    if is_w1:
        print(f"{args.shape}, {args.kv_gib:g} GiB of KV, W1 ({args.num_requests} requests):")
        for r in rows:
            print(f"  {r['mode']:8s} ({r['tables']}): {r['num_blocks']} blocks, "
                  f"{r['max_running']} running at most, {r['mean_running']} on average, "
                  f"{r['preemptions']} preemptions of {r['requests_preempted']} requests, "
                  f"{r['recomputed_prompt_tokens']} prompt tokens computed again, "
                  f"{r['steps']} steps")  # fmt: skip
    else:
        print(f"{args.shape}, {args.kv_gib:g} GiB of KV, {args.num_requests} x "
              f"({args.prompt_len} + {args.output_len}) tokens:")  # fmt: skip
        for r in rows:
            print(f"  {r['mode']:8s} ({r['tables']}): {r['num_blocks']} blocks, "
                  f"{r['max_long_seqs_held']} sequences past {args.long_at} tokens at once "
                  f"({r['max_running']} running at most), {r['preemptions']} preemptions")  # fmt: skip
        print(f"  -> {ratio:.2f}x the long sequences held at once")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                        "rows": rows, "ratio": ratio}, indent=2) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
