"""Cost of the C++ block manager per operation, against a plain-Python baseline.

Times allocate / append_slot / fork / free per call for --num-seqs sequences of ~--seq-len
tokens, for pydaemon._core.BlockManager and for PyBlockManager below (free list + ref_counts +
block tables in plain Python). Medians of many calls (time.perf_counter_ns). The per-step
metadata (block tables, slot mapping) is built vectorised by the model runner's InputBatch.

    PYTHONPATH=. python bench/bench_block_manager.py            # 512 seqs x ~700 tokens
    PYTHONPATH=. python bench/bench_block_manager.py --rounds 1  # quicker

Writes bench/results/block_manager_<date>.json and bench/results/block_manager.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pydaemon._core import BlockManager


class PyBlockManager:
    """The baseline: the same bookkeeping (no prefix cache, no swap) in plain Python."""

    def __init__(self, block_size: int, num_gpu_blocks: int) -> None:
        self.block_size = block_size
        self.free_blocks = list(range(num_gpu_blocks - 1, -1, -1))  # pop() takes block 0 first
        self.ref_count = [0] * num_gpu_blocks
        self.block_tables: dict[int, list[int]] = {}
        self.token_ids: dict[int, list[int]] = {}

    def _pop(self) -> int:
        if not self.free_blocks:
            raise RuntimeError("no free block")
        b = self.free_blocks.pop()
        self.ref_count[b] = 1
        return b

    def allocate(self, seq_id: int, token_ids: list[int]) -> int:
        if seq_id in self.block_tables:
            raise RuntimeError(f"sequence {seq_id} exists")
        n = -(-len(token_ids) // self.block_size)
        if n > len(self.free_blocks):
            raise RuntimeError("no free blocks")
        self.block_tables[seq_id] = [self._pop() for _ in range(n)]
        self.token_ids[seq_id] = list(token_ids)
        return 0

    def append_slot(self, seq_id: int, token_id: int) -> tuple[int, int] | None:
        table, tokens = self.block_tables[seq_id], self.token_ids[seq_id]
        cow = None
        if len(tokens) % self.block_size == 0:
            table.append(self._pop())
        elif self.ref_count[table[-1]] > 1:
            dst = self._pop()
            self.ref_count[table[-1]] -= 1
            cow = (table[-1], dst)
            table[-1] = dst
        tokens.append(token_id)
        return cow

    def fork(self, parent_id: int, child_id: int) -> None:
        table = self.block_tables[parent_id]
        for b in table:
            self.ref_count[b] += 1
        self.block_tables[child_id] = list(table)
        self.token_ids[child_id] = list(self.token_ids[parent_id])

    def free(self, seq_id: int) -> None:
        table = self.block_tables.pop(seq_id)
        del self.token_ids[seq_id]
        for b in reversed(table):
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self.free_blocks.append(b)


def per_call_ns(calls: list[Callable[[], object]]) -> float:
    """Median over single calls (each timed alone)."""
    samples = []
    for fn in calls:
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples)


def run(impl: str, args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(0)
    n, bs = args.num_seqs, args.block_size
    lens = [args.seq_len + rng.randint(-32, 32) for _ in range(n)]
    prompts = [[rng.randrange(32000) for _ in range(length)] for length in lens]
    num_blocks = sum(-(-(length + args.decode_steps) // bs) for length in lens) * 2 + 64
    results: dict[str, float] = {}
    alloc_ns, free_ns, append_ns, fork_ns = [], [], [], []
    for _ in range(args.rounds):
        bm = (
            BlockManager(bs, num_blocks, 0, 0.0, not args.no_prefix_caching)
            if impl == "cpp"
            else PyBlockManager(bs, num_blocks)
        )
        alloc_ns.append(
            per_call_ns([lambda i=i, bm=bm: bm.allocate(i, prompts[i]) for i in range(n)])
        )
        for step in range(args.decode_steps):
            append_ns.append(
                per_call_ns([lambda i=i, bm=bm, t=step: bm.append_slot(i, t) for i in range(n)])
            )
        fork_ns.append(per_call_ns([lambda i=i, bm=bm: bm.fork(i, n + i) for i in range(n)]))
        for i in range(n):
            bm.free(n + i)
        free_ns.append(per_call_ns([lambda i=i, bm=bm: bm.free(i) for i in range(n)]))
    results.update(
        allocate_us=statistics.median(alloc_ns) / 1e3,
        append_slot_us=statistics.median(append_ns) / 1e3,
        fork_us=statistics.median(fork_ns) / 1e3,
        free_us=statistics.median(free_ns) / 1e3,
    )
    return results


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=700, help="prompt length (+-32)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--decode-steps", type=int, default=4, help="append_slot rounds")
    p.add_argument("--rounds", type=int, default=3, help="fresh managers per implementation")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args()

    cpp, py = run("cpp", args), run("python", args)

    rows = [(op, cpp[op], py[op], py[op] / cpp[op]) for op in cpp]
    header = "| operation | C++ (us) | Python (us) | speed-up |"
    lines = [header, "|---|---:|---:|---:|"]
    lines += [f"| {op[:-3]} | {c:.3f} | {q:.3f} | {q / c:.1f}x |" for op, c, q, _ in rows]
    table = "\n".join(lines)
    print(table)

    now = dt.datetime.now(dt.timezone.utc)
    record = {
        "date": now.isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
        },
        "git_commit": git_commit(),
        "command": " ".join([sys.executable, *sys.argv]),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "median_us": {"cpp": cpp, "python": py},
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / f"block_manager_{now:%Y-%m-%d}.json"
    json_path.write_text(json.dumps(record, indent=2) + "\n")
    md = (
        f"# Block manager: C++ vs plain Python\n\n"
        f"{args.num_seqs} sequences of ~{args.seq_len} tokens, block_size {args.block_size}; "
        f"median per call (allocate/append_slot/fork/free).\n\n{table}\n\n"
        f"{record['date']}, {record['machine']['platform']}, "
        f"{record['machine']['processor']}, commit {record['git_commit'][:12]}.\n"
        f"Command: `{record['command']}`. Raw figures: `{json_path.name}`.\n"
    )
    (args.out_dir / "block_manager.md").write_text(md)
    print(f"wrote {json_path} and {args.out_dir / 'block_manager.md'}")


if __name__ == "__main__":
    main()
