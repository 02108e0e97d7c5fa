"""TPOT at batch 1 with a 1k-token prompt on the Llama-3-8B shape: eager vs CUDA graphs.

Two engines on the same dummy weights (same seed) live side by side in one process, one with
``enforce_eager=True``, one with decode graphs; their runs alternate so that both see the same
machine state. A run is one request (``--prompt-len`` random W1-style token ids, greedy, EOS
ignored, ``--output-len`` tokens) stepped through the in-process engine; as in
bench/tpot_smollm2.py, TPOT = (latency - TTFT) / (output tokens - 1), every step ending with
the sampled id on the host. Reported per mode: medians over runs of TTFT, TPOT and the median
decode step, the bytes a decode step reads (weights + KV so far) over TPOT as achieved
bandwidth and as a fraction of the device copy ceiling measured in the same run, and the
eager / graphs TPOT ratio.

    python bench/throughput_models.py llama3-8b /tmp/llama3-8b
    PYTHONPATH=. python bench/tpot_batch1.py --model /tmp/llama3-8b \\
        --out bench/results/tpot_batch1_h200_<date>.json
    PYTHONPATH=. python bench/tpot_batch1.py --model demo --device cpu --output-len 8 --runs 1
    PYTHONPATH=. python bench/tpot_batch1.py --quantization gptq   # int4 g128 dummy weights
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.loadgen_env import environment, write_json  # noqa: E402
from bench.throughput_models import write_model_config  # noqa: E402
from pydaemon.generate_request import GenerateRequest

MODES = {"eager": True, "graphs": False}  # mode -> enforce_eager


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tpot_batch1", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="model directory (dummy weights unless --load-format auto); default: "
                        "a temp dir with the llama3-8b config")  # fmt: skip
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default=None,
                   choices=("fp8", "fp8_emulated", "awq", "gptq", "compressed-tensors", "mxfp4"),
                   help="weights quantized (dummy weights: drawn in that layout, int4 group 128)")  # fmt: skip
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--runs", type=int, default=5, help="per mode, alternating")
    p.add_argument("--max-num-seqs", type=int, default=512, help="sets the graphs' buckets")
    p.add_argument("--num-kv-blocks", type=int, default=512, help="per engine (both fit)")
    p.add_argument("--modes", default="eager,graphs", help=f"comma-separated, of {list(MODES)}")
    p.add_argument("--out", default=None, help="JSON file to write")
    return p


def run_once(llm, prompt_ids: list[int], output_len: int, device: str) -> dict:
    import time

    import torch

    from pydaemon import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    engine.add_request(GenerateRequest("tpot", list(prompt_ids), params))
    step_ends: list[float] = []
    token_times: list[float] = []  # when each delivered token reached the caller
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        outputs = engine.step()  # deltas: the tokens new since the last step
        now = time.perf_counter()
        step_ends.append(now)
        for out in outputs:
            new = list(out.outputs[0].token_ids) if out.outputs else []
            tokens.extend(new)
            token_times.extend([now] * len(new))
    ttft, latency = token_times[0] - start, token_times[-1] - start
    steps = [b - a for a, b in zip(step_ends[:-1], step_ends[1:], strict=True)]
    return {
        "ttft_ms": ttft * 1e3,
        "tpot_ms": (latency - ttft) / max(1, len(tokens) - 1) * 1e3,
        "median_decode_step_ms": statistics.median(steps) * 1e3 if steps else 0.0,
        "output_tokens": len(tokens),
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        print(f"tpot_batch1: --modes must name some of {list(MODES)}", file=sys.stderr)
        return 2
    if args.model is None:
        args.model = str(write_model_config("llama3-8b"))
    from pydaemon import LLM

    common = dict(device=args.device, dtype=args.dtype, load_format=args.load_format,
                  num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
                  enable_prefix_caching=False, swap_space=0.5, seed=0,
                  quantization=args.quantization)  # fmt: skip
    if args.model == "demo":
        common.pop("load_format")
    engines = {m: LLM(args.model, enforce_eager=MODES[m], **common) for m in modes}
    cfg = next(iter(engines.values())).engine.model_config
    rng = random.Random(0)
    prompt = [rng.randrange(100, min(30000, cfg.vocab_size)) for _ in range(args.prompt_len)]
    for llm in engines.values():  # warm-up: allocator, kernels, first replays
        run_once(llm, prompt, 8, args.device)
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.runs):
        for mode, llm in engines.items():
            runs[mode].append(run_once(llm, prompt, args.output_len, args.device))

    runner = next(iter(engines.values())).engine.runner
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_bytes_per_token = (
        2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * runner.dtype.itemsize
    )
    step_bytes = weight_bytes + kv_bytes_per_token * (args.prompt_len + args.output_len / 2)
    ceiling = None
    if args.device == "cuda":
        from bench.timing import copy_bandwidth_gbs

        ceiling = copy_bandwidth_gbs()["gbs"]
    results = {}
    for mode, mode_runs in runs.items():
        med = {k: statistics.median(r[k] for r in mode_runs)
               for k in ("ttft_ms", "tpot_ms", "median_decode_step_ms")}  # fmt: skip
        med["achieved_gbs"] = step_bytes / (med["tpot_ms"] * 1e6)
        if ceiling:
            med["fraction_of_copy_ceiling"] = med["achieved_gbs"] / ceiling
        graphs = engines[mode].engine.runner.cuda_graphs
        med["num_graph_replays"] = 0 if graphs is None else graphs.num_replays
        results[mode] = {**med, "runs": [{k: v for k, v in r.items() if k != "tokens"}
                                         for r in mode_runs]}  # fmt: skip
    report = {
        "meta": {
            **environment(["bench/tpot_batch1.py", *(argv or sys.argv[1:])]),
            "benchmark": "tpot_batch1",
        },  # fmt: skip
        "workload": {
            "model": args.model,
            "load_format": common.get("load_format"),
            "dtype": args.dtype,
            "quantization": args.quantization,
            "batch_size": 1,
            "prompt_tokens": args.prompt_len,
            "output_tokens": args.output_len,
            "runs": args.runs,
            "max_num_seqs": args.max_num_seqs,
            "weight_bytes": weight_bytes,
            "kv_bytes_per_token": kv_bytes_per_token,
        },
        "copy_ceiling_gbs": ceiling,
        "results": results,
    }
    if "eager" in results and "graphs" in results:
        report["eager_over_graphs_tpot"] = (
            results["eager"]["tpot_ms"] / results["graphs"]["tpot_ms"]
        )
        # Greedy on random weights: bf16 near-ties may flip a token; reported, not asserted.
        same = [
            a["tokens"] == b["tokens"] for a, b in zip(runs["eager"], runs["graphs"], strict=True)
        ]
        report["same_tokens_fraction"] = sum(same) / len(same)
    print(f"{'mode':8} {'TTFT ms':>9} {'TPOT ms':>9} {'step ms':>9} {'tok/s':>8} {'GB/s':>8}")
    for mode, r in results.items():
        print(f"{mode:8} {r['ttft_ms']:9.2f} {r['tpot_ms']:9.3f} {r['median_decode_step_ms']:9.3f} "
              f"{1e3 / r['tpot_ms']:8.1f} {r['achieved_gbs']:8.1f}")  # fmt: skip
    if "eager_over_graphs_tpot" in report:
        print(f"eager / graphs TPOT: {report['eager_over_graphs_tpot']:.2f}x")
    if ceiling:
        print(f"copy ceiling {ceiling:.0f} GB/s")
    if args.out:
        write_json(Path(args.out), report)
        print(f"wrote {args.out}", file=sys.stderr)
    for llm in engines.values():
        llm.engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
