"""Per-step cost of structured outputs at a given batch: filling the grammar bitmask on the host
(xgrammar's batch matcher over every constrained sequence) and applying it to the logits on
the device, for a Llama-3-sized vocabulary (128,256 tokens; synthetic byte-level BPE).

Each of ``batch`` sequences runs its own JSON schema matcher, advanced to a random point of a
random valid output first (so rows sit in different grammar states, as in a real batch); then
each timed step advances every matcher by one allowed token, fills the bitmask, copies it to
the device and masks the logits (bench/timing.py's medians; the device part with CUDA events).

    PYTHONPATH=. python bench/bench_grammar_mask.py --batch 1,64,256 --out results/mask.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.synthetic_tokenizer import write_tokenizer  # noqa: E402
from pydaemon.sampling.bitmask import apply_grammar_bitmask  # noqa: E402
from pydaemon.sampling_params import StructuredOutputsParams  # noqa: E402
from pydaemon.structured_output.compiler import GrammarCompiler  # noqa: E402
from pydaemon.structured_output.matchers import ConstrainedSeq, GrammarMatchers  # noqa: E402
from pydaemon.tokenizer.hf import HFTokenizer  # noqa: E402
from pydaemon.tokenizer.token_bytes import token_bytes  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "zip"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["id", "name", "email", "tags", "address", "active"],
}


def _allowed(bitmask_row: torch.Tensor, vocab: int) -> list[int]:
    bits = (bitmask_row.view(torch.uint8)[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1
    return torch.flatten(bits).nonzero().flatten()[:vocab].tolist()


def bench(batch: int, steps: int, vocab: int, compiler, device: torch.device, seed: int) -> dict:
    rng = random.Random(seed)
    outputs: dict[int, list[int]] = {i: [] for i in range(batch)}
    matchers = GrammarMatchers(compiler)
    schemas = [dict(SCHEMA, title=f"s{i % 8}") for i in range(batch)]  # 8 distinct grammars
    rows = [
        ConstrainedSeq(i, f"r{i}", StructuredOutputsParams(json=schemas[i]), outputs[i])
        for i in range(batch)
    ]
    for row in rows:  # warm the compile cache
        compiler.get(row.spec)
    logits = torch.randn(batch, vocab, device=device)
    # Walk each sequence to a random point: allowed tokens only.
    for i, row in enumerate(rows):
        for _ in range(rng.randint(0, 40)):
            mask = torch.from_numpy(matchers.fill_bitmask([row])[0].copy())
            allowed = [t for t in _allowed(mask, vocab) if t not in compiler.stop_token_ids]
            if not allowed:
                break
            outputs[i].append(rng.choice(allowed))
    fill_ms, apply_ms, total_ms = [], [], []
    for _ in range(steps):
        for i, row in enumerate(rows):  # one allowed token each (host bookkeeping, not timed)
            mask = torch.from_numpy(matchers.fill_bitmask([row])[0].copy())
            allowed = [t for t in _allowed(mask, vocab) if t not in compiler.stop_token_ids]
            if allowed:
                outputs[i].append(rng.choice(allowed))
        if device.type == "cuda":
            torch.cuda.synchronize()
        before = matchers.stats.fill_s
        start = time.perf_counter()
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        # The engine core fills the bitmask; the worker copies it down and masks the logits.
        bitmask = torch.from_numpy(matchers.fill_bitmask(rows)).to(device, non_blocking=True)
        apply_grammar_bitmask(logits, bitmask)
        if device.type == "cuda":
            end.record()
            torch.cuda.synchronize()
            apply_ms.append(begin.elapsed_time(end))
        total_ms.append((time.perf_counter() - start) * 1e3)
        fill_ms.append((matchers.stats.fill_s - before) * 1e3)
    return {
        "batch": batch,
        "steps": steps,
        "fill_ms_median": statistics.median(fill_ms),
        "device_ms_median": statistics.median(apply_ms) if apply_ms else None,
        "step_total_ms_median": statistics.median(total_ms),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", default="1,64,256", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--vocab-size", type=int, default=128256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = HFTokenizer.from_dir(write_tokenizer(tmp, args.vocab_size))
    start = time.perf_counter()
    compiler = GrammarCompiler(
        token_bytes(tokenizer), args.vocab_size, sorted(tokenizer.eos_token_ids)
    )
    setup_s = time.perf_counter() - start
    results = [
        bench(int(b), args.steps, args.vocab_size, compiler, torch.device(args.device), args.seed)
        for b in args.batch.split(",")
    ]
    report = {"vocab_size": args.vocab_size, "device": args.device,
              "tokenizer_info_s": setup_s, "results": results}  # fmt: skip
    print(f"{'batch':>6} {'fill ms':>9} {'device ms':>10} {'host total ms':>14}")
    for r in results:
        device_ms = "-" if r["device_ms_median"] is None else f"{r['device_ms_median']:.3f}"
        print(f"{r['batch']:>6} {r['fill_ms_median']:>9.3f} {device_ms:>10} "
              f"{r['step_total_ms_median']:>14.3f}")  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
