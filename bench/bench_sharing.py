"""KV memory accounting of shared blocks: parallel sampling (n=4) and beam search (width 4).

Per run: peak GPU blocks in use, KV waste (allocated minus filled slots) at that peak, and
the blocks that sharing saved at that peak (blocks the live sequences' tables name, counted
once per sequence, minus the distinct blocks in use). Runs on the built-in demo model by
default (CPU is fine: these are block counts, not speeds).

    python bench/bench_sharing.py --out bench/results/sharing_<date>.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pydaemon import LLM, SamplingParams  # noqa: E402
from pydaemon._core import Device  # noqa: E402
from pydaemon.generate_request import GenerateRequest


def measure(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    engine = llm.engine
    bm = engine.block_manager
    peak = {"used": -1}
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerateRequest(f"r{i}", prompt, params))
    while engine.has_unfinished_requests():
        engine.step()
        used = bm.num_used_blocks(Device.GPU)
        if used > peak["used"]:
            referenced = sum(
                len(bm.block_table(s)) for s in bm.seq_ids() if bm.seq_device(s) == Device.GPU
            )
            peak = {
                "used": used,
                "referenced_by_tables": referenced,
                "saved_by_sharing": referenced - used,
                "shared_blocks": bm.num_shared_blocks(),
                "kv_waste_slots": bm.kv_waste(),
                "live_sequences": sum(len(r.seqs) for r in engine.scheduler.running),
            }
    assert bm.num_free_blocks(Device.GPU) == bm.num_total_blocks(Device.GPU)
    block_size = bm.block_size()
    return {
        "peak_blocks_used": peak["used"],
        "blocks_needed_without_sharing": peak["referenced_by_tables"],
        "blocks_saved_by_sharing": peak["saved_by_sharing"],
        "saved_fraction": peak["saved_by_sharing"] / max(1, peak["referenced_by_tables"]),
        "shared_blocks_at_peak": peak["shared_blocks"],
        "kv_waste_slots_at_peak": peak["kv_waste_slots"],
        "kv_waste_fraction_at_peak": peak["kv_waste_slots"] / max(1, peak["used"] * block_size),
        "live_sequences_at_peak": peak["live_sequences"],
        "num_preemptions": engine.get_stats().num_preemptions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(200, 400))
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rng = random.Random(0)
    llm_probe = LLM(args.model, device=args.device, num_kv_blocks=8)
    vocab = llm_probe.engine.vocab_size
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(*args.prompt_len))]
        for _ in range(args.num_requests)
    ]
    runs = {
        "n=1 (baseline)": SamplingParams(
            n=1, temperature=0.8, seed=1, max_tokens=args.max_tokens, ignore_eos=True
        ),
        "n=4 parallel sampling": SamplingParams(
            n=4, temperature=0.8, seed=1, max_tokens=args.max_tokens, ignore_eos=True
        ),
        "beam width 4": SamplingParams(
            beam_width=4, n=4, temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True
        ),
    }
    results = {}
    for name, params in runs.items():
        llm = LLM(
            args.model,
            device=args.device,
            block_size=args.block_size,
            num_kv_blocks=8192,
            enable_prefix_caching=False,
        )
        results[name] = measure(llm, prompts, params)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "commit": commit,
        "command": " ".join(sys.argv),
        "workload": {
            "model": args.model,
            "num_requests": args.num_requests,
            "prompt_len": list(args.prompt_len),
            "max_tokens": args.max_tokens,
            "block_size": args.block_size,
            "prefix_caching": False,
        },
        "results": results,
    }
    print(
        f"{'run':24} {'peak used':>10} {'w/o sharing':>12} {'saved':>7} {'saved %':>8} {'waste %':>8}"
    )
    for name, r in results.items():
        print(
            f"{name:24} {r['peak_blocks_used']:>10} {r['blocks_needed_without_sharing']:>12} "
            f"{r['blocks_saved_by_sharing']:>7} {100 * r['saved_fraction']:>7.1f}% "
            f"{100 * r['kv_waste_fraction_at_peak']:>7.1f}%"
        )
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
