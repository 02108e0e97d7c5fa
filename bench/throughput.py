"""Offline throughput: a workload through pagedd's ``LLM.generate`` in process, and the same
workload through transformers' continuous batching and static-batch ``generate``.

    PYTHONPATH=. python bench/throughput.py --model-config llama3-8b            # W1, pagedd
    PYTHONPATH=. python bench/throughput.py --model-config llama3-8b \
        --backend pagedd,pagedd-fp8 --compare          # W1, bf16 and FP8 weights, side by side
    PYTHONPATH=. python bench/throughput.py --model-config llama3-8b \\
        --backend pagedd,hf-continuous,hf-static --num-requests 64 --compare
    PYTHONPATH=. python bench/throughput.py --model-config llama3-8b \\
        --backend pagedd,pagedd-sync --compare    # async scheduling on (default) vs off
    PYTHONPATH=VLLM_SITE:. VLLM_USE_FLASHINFER_SAMPLER=0 python bench/throughput.py \\
        --model-config llama3-8b --backend vllm --tpot-batch1 5   # the peer engine, + TPOT

Reports wall time (first submit to last token), output and total tokens/s, and for pagedd
the peak KV blocks in use, the KV waste (allocated slots holding no token) and preemptions.
``--tpot-batch1 RUNS`` then measures TPOT at batch 1 on the same engine (bench/tpot_generate.py:
the same method for pagedd and vLLM); ``--profile`` runs the workload under torch.profiler and
adds where the GPU time went (bench/gpu_breakdown.py). vLLM (bench/throughput_vllm.py) runs
with its own defaults unless a flag sets them. Several backends run one after the other, each
in its own process (so that each gets the whole GPU), and ``--compare`` prints pagedd's
throughput over each peer's. See bench/throughput_hf.py for how the peers are run and why
their weights differ.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import kernel_switches, moe_routing  # noqa: E402
from bench.loadgen_env import environment, write_json  # noqa: E402
from bench.throughput_models import MODEL_CONFIGS, write_model_config  # noqa: E402
from bench.workloads import add_workload_flags, build_workload, summarize  # noqa: E402

# pagedd-sync: pagedd with async scheduling off (--no-async-scheduling), to compare with.
# pagedd-fp8: pagedd with --quantization fp8 (FP8 weights, quantized at load).
# pagedd-ray: pagedd with its rank(s) as Ray actors (--distributed-executor-backend ray).
# vllm, vllm-fp8: the peer engine (vLLM's offline LLM; vllm-fp8: --quantization fp8).
BACKENDS = (
    "pagedd",
    "pagedd-sync",
    "pagedd-fp8",
    "pagedd-ray",
    "vllm",
    "vllm-fp8",
    "hf-continuous",
    "hf-static",
)


QUANTIZATIONS = ("fp8", "fp8_emulated", "awq", "gptq", "compressed-tensors", "mxfp4")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="throughput", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--backend", default="pagedd", help=f"comma-separated, of {', '.join(BACKENDS)}")
    m = p.add_argument_group("model")
    m.add_argument(
        "--model", default=None, help="'demo' or a model directory (config.json at least)"
    )
    m.add_argument("--model-config", choices=sorted(MODEL_CONFIGS), default=None,
                   help="write this shape's config.json to a temp dir and use dummy weights")  # fmt: skip
    m.add_argument("--load-format", choices=("auto", "dummy"), default=None)
    m.add_argument("--device", default=None, help="auto, cpu or cuda")
    m.add_argument("--dtype", default=None, help="auto, float32, float16 or bfloat16")
    m.add_argument("--seed", type=int, default=0, help="weights (dummy) and synthetic prompts")
    e = p.add_argument_group("pagedd engine")
    for flag, type_ in (("--block-size", int), ("--num-kv-blocks", int), ("--max-num-seqs", int),
                        ("--max-num-batched-tokens", int), ("--max-model-len", int),
                        ("--gpu-memory-utilization", float), ("--preemption-mode", str),
                        ("--tensor-parallel-size", int)):  # fmt: skip
        e.add_argument(flag, type=type_, default=None)
    e.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3"), default=None,
                   help="KV-cache storage: auto (the model's dtype) or fp8 (e4m3)")  # fmt: skip
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument("--kv-offloading-size", type=float, default=None,
                   help="GiB of the CPU tier of the prefix cache (pagedd; default: off)")  # fmt: skip
    e.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    e.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap each step's host work with the GPU (default: on for CUDA)")  # fmt: skip
    e.add_argument("--json-schema-workload", action="store_true",
                   help="every request carries a JSON schema (structured outputs; a synthetic "
                   "tokenizer is written for a model without one); compile cache warmed first")  # fmt: skip
    e.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="FP8 weights (fp8: CUDA sm_89+), or 4-bit weights in a checkpoint "
                   "format's layout (awq / gptq / compressed-tensors: int4 group 128; mxfp4: "
                   "MoE experts; with dummy weights); default: as the checkpoint is")  # fmt: skip
    kernel_switches.add_arguments(p)
    moe_routing.add_arguments(p)
    h = p.add_argument_group("transformers peers")
    h.add_argument("--static-batch-size", type=int, default=64, help="hf-static batch size")
    h.add_argument("--hf-num-requests", type=int, default=None,
                   help="run the peers on only the first N requests (they are slow); stated in the output")  # fmt: skip
    t = p.add_argument_group("TPOT at batch 1 and GPU profile (pagedd and vllm)")
    t.add_argument("--tpot-batch1", type=int, default=0, metavar="RUNS",
                   help="after the workload, TPOT at batch 1 on the same engine (0: not)")  # fmt: skip
    t.add_argument("--tpot-batch", type=int, default=0, metavar="RUNS",
                   help="after the workload, TPOT at batch --tpot-batch-size (0: not)")  # fmt: skip
    t.add_argument("--tpot-batch-size", type=int, default=64)
    t.add_argument("--tpot-prompt-len", type=int, default=1024)
    t.add_argument("--tpot-output-len", type=int, default=128)
    t.add_argument("--profile", action="store_true",
                   help="run the workload under torch.profiler: GPU time by kernel kind, idle time")  # fmt: skip
    add_workload_flags(p)
    o = p.add_argument_group("output")
    o.add_argument(
        "--compare", action="store_true", help="print pagedd's throughput over each peer's"
    )
    o.add_argument(
        "--out", default=None, help="JSON file (default bench/results/throughput_<date>.json)"
    )
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--quiet", action="store_true", help="no table")
    return p


def _backends(text: str) -> list[str]:
    names = [b.strip() for b in text.split(",") if b.strip()]
    bad = [b for b in names if b not in BACKENDS]
    if bad or not names:
        raise ValueError(
            f"unknown backend {bad[0] if bad else text!r}: expected {', '.join(BACKENDS)}"
        )
    return names


def _resolve_model(args: argparse.Namespace) -> None:
    if args.model_config:
        if args.model:
            raise ValueError("give --model or --model-config, not both")
        args.model = str(write_model_config(args.model_config))
        args.load_format = args.load_format or "dummy"
    args.model = args.model or "demo"
    if args.model != "demo" and not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"--model {args.model}: no config.json there")
    has_tokenizer = any(
        (Path(args.model) / f).is_file() for f in ("tokenizer.json", "tokenizer.model")
    )
    if getattr(args, "json_schema_workload", False) and args.model != "demo" and not has_tokenizer:
        from bench.synthetic_tokenizer import write_tokenizer

        vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
        write_tokenizer(args.model, vocab)  # structured outputs spell grammars with it


def run_backend(backend: str, args: argparse.Namespace) -> dict:
    """One backend in this process."""
    is_pagedd = backend in ("pagedd", "pagedd-sync", "pagedd-fp8", "pagedd-ray")
    is_vllm = backend in ("vllm", "vllm-fp8")
    n = (
        args.hf_num_requests
        if not (is_pagedd or is_vllm) and args.hf_num_requests
        else args.num_requests
    )
    args.num_requests = n
    vocab = None
    if args.model != "demo":
        vocab = json.loads((Path(args.model) / "config.json").read_text()).get("vocab_size")
    requests = build_workload(args, vocab_size=vocab or (512 if args.model == "demo" else None))
    if is_pagedd:
        from bench.throughput_pagedd import run_pagedd

        if backend == "pagedd-sync":
            args.async_scheduling = False
        if backend == "pagedd-fp8":
            args.quantization = "fp8"
        if backend == "pagedd-ray":
            args.distributed_executor_backend = "ray"

        figures = run_pagedd(args.model, requests, args, vocab_size=vocab)
    elif is_vllm:
        if args.model == "demo":
            raise ValueError("the vllm backend needs a model directory (--model or --model-config)")
        from bench.throughput_vllm import run_vllm

        if backend == "vllm-fp8":
            args.quantization = "fp8"
        figures = run_vllm(args.model, requests, args, vocab_size=vocab)
    else:
        if args.model == "demo":
            from pydaemon.model_loader.demo_model import demo_model_dir

            args.model = str(demo_model_dir())
        from bench import throughput_hf

        run = (
            throughput_hf.run_hf_continuous
            if backend == "hf-continuous"
            else throughput_hf.run_hf_static
        )
        figures = run(args.model, requests, args)
    wall = max(figures["wall_s"], 1e-9)
    figures.update(
        backend=backend,
        workload={"name": args.workload, **summarize(requests)},
        output_throughput=figures["num_output_tokens"] / wall,
        total_token_throughput=(figures["num_output_tokens"] + figures["num_prompt_tokens"]) / wall,
        request_throughput=len(requests) / wall,
    )
    return figures


def _child_argv(argv: list[str], backend: str, out: Path) -> list[str]:
    """argv without --backend/--out/--compare/--model-config, for one backend's process."""
    drop_with_value = {"--backend", "--out", "--model-config", "--model", "--load-format"}
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in drop_with_value:
            skip = "=" not in a
            continue
        if name == "--compare":
            continue
        kept.append(a)
    return kept + ["--backend", backend, "--out", str(out), "--quiet"]


def _cell(r: dict, key: str):
    value = r.get(key)
    return "-" if value is None else value


def table(results: list[dict], compare: bool) -> str:
    head = (f"{'backend':<14} {'requests':>8} {'wall s':>8} {'out tok/s':>10} {'total tok/s':>11} "
            f"{'KV blocks':>9} {'peak KV blk':>11} {'waste %':>7} {'preempt':>7}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in results:
        waste = r.get("kv_waste", {}).get("fraction_at_peak")
        lines.append(
            f"{r['backend']:<14} {r['workload']['num_requests']:>8} {r['wall_s']:8.2f} "
            f"{r['output_throughput']:10.1f} {r['total_token_throughput']:11.1f} "
            f"{_cell(r, 'num_gpu_blocks'):>9} {_cell(r, 'peak_kv_blocks_used'):>11} "
            f"{'-' if waste is None else f'{100 * waste:.1f}':>7} {_cell(r, 'num_preemptions'):>7}"
        )
        tpot = r.get("tpot_batch1")
        if tpot:
            lines.append(f"  {r['backend']}: TPOT at batch 1 {tpot['tpot_ms']:.3f} ms, "
                         f"TTFT {tpot['ttft_ms']:.1f} ms ({tpot['prompt_len']}-token prompt)")  # fmt: skip
        tpot = r.get("tpot_batch")
        if tpot:
            lines.append(f"  {r['backend']}: TPOT at batch {tpot['batch_size']} "
                         f"{tpot['tpot_ms']:.3f} ms ({tpot['prompt_len']}-token prompts)")  # fmt: skip
        for phase, summary in (r.get("moe_routing") or {}).items():
            if isinstance(summary, dict) and ("by_step_tokens" in summary or "note" in summary):
                lines.append(f"  {r['backend']}: routing, {phase}: {moe_routing.describe(summary)}")
        gpu = r.get("gpu_breakdown")
        if gpu:
            kinds = ", ".join(f"{k} {v:.0f}" for k, v in gpu["ms_by_kind"].items())
            lines.append(f"  {r['backend']}: GPU ms busy {gpu['busy_ms']:.0f} of "
                         f"{gpu['span_ms']:.0f} (idle {gpu['idle_ms']:.0f}): {kinds}")  # fmt: skip
    base = next((r for r in results if r["backend"] == "pagedd"), None)
    if compare and base is not None:
        for r in results:
            if r is base:
                continue
            same = r["workload"]["num_requests"] == base["workload"]["num_requests"]
            lines.append(
                f"pagedd / {r['backend']}: {base['output_throughput'] / r['output_throughput']:.2f}x "
                f"output tok/s"
                + (
                    ""
                    if same
                    else f" (pagedd on {base['workload']['num_requests']} requests, {r['backend']} on "
                    f"{r['workload']['num_requests']}: not the same workload)"
                )  # fmt: skip
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        backends = _backends(args.backend)
        _resolve_model(args)
    except ValueError as e:
        print(f"throughput: {e}", file=sys.stderr)
        return 2
    out = Path(args.out or f"bench/results/throughput_{time.strftime('%Y%m%d_%H%M%S')}.json")
    meta = {**environment(["bench/throughput.py", *argv]), "model": args.model,
            "load_format": args.load_format, "benchmark": "throughput"}  # fmt: skip
    results = []
    if len(backends) == 1:
        try:
            results.append(run_backend(backends[0], args))
        except ValueError as e:
            print(f"throughput: {e}", file=sys.stderr)
            return 2
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for backend in backends:
                child_out = Path(tmp) / f"{backend}.json"
                cmd = [sys.executable, __file__, *_child_argv(argv, backend, child_out),
                       "--model", args.model] + (["--load-format", args.load_format] if args.load_format else [])  # fmt: skip
                print(f"== {backend}: {' '.join(cmd[2:])}", file=sys.stderr)
                if subprocess.run(cmd).returncode != 0 or not child_out.is_file():
                    print(f"throughput: backend {backend} failed", file=sys.stderr)
                    continue
                results.extend(json.loads(child_out.read_text())["results"])
    meta["gpu"] = meta["gpu"] or environment()["gpu"]  # torch is imported by now
    write_json(out, {"meta": meta, "results": results})
    if not args.quiet:
        print(table(results, args.compare))
    print(f"wrote {out}", file=sys.stderr)
    return 0 if len(results) == len(backends) else 1


if __name__ == "__main__":
    raise SystemExit(main())
