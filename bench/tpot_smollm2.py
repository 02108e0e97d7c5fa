"""TPOT at batch 1 of the default model (SmolLM2-135M-Instruct, Q4_1 GGUF dequantized at load).

One request at a time through the in-process engine (``LLM``), EOS ignored, greedy: the
time of every engine step is taken on the host (a step ends with the sampled ids on the host,
so it is synchronous). Per run: TTFT (the prefill step), TPOT = (latency - TTFT) / (output
tokens - 1) as in vLLM's benchmark, and the median decode step. Reported: medians over runs,
the bytes a decode step must read (weights + the KV cache so far) over the TPOT as achieved
bandwidth, and on CUDA that as a fraction of the device copy ceiling measured in the same
run. ``--hf-peer`` times transformers' ``generate`` on the same weights for comparison.

    PYTHONPATH=. python bench/tpot_smollm2.py --out bench/results/tpot_smollm2_h200_<date>.json
    PYTHONPATH=. python bench/tpot_smollm2.py --device cpu --output-len 16 --runs 2  # smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pydaemon import LLM, SamplingParams  # noqa: E402
from pydaemon.generate_request import GenerateRequest
from pydaemon.model_loader.default_model import DEFAULT_MODEL, default_model_path  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_pagedd(llm: LLM, prompt_ids: list[int], output_len: int, device: str) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    _sync(device)
    start = time.perf_counter()
    engine.add_request(GenerateRequest("tpot", list(prompt_ids), params))
    step_ends: list[float] = []
    num_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            num_tokens += len(out.outputs[0].token_ids) if out.outputs else 0
        step_ends.append(time.perf_counter())
    ttft = step_ends[0] - start
    latency = step_ends[-1] - start
    decode_steps = [b - a for a, b in zip(step_ends[:-1], step_ends[1:], strict=True)]
    return {
        "ttft_ms": ttft * 1e3,
        "tpot_ms": (latency - ttft) / max(1, num_tokens - 1) * 1e3,
        "median_decode_step_ms": statistics.median(decode_steps) * 1e3 if decode_steps else 0.0,
        "output_tokens": num_tokens,
    }


def run_hf(model, prompt_ids: list[int], output_len: int, device: str) -> dict:
    ids = torch.tensor([prompt_ids], device=device)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    times = {}
    for n in (1, output_len):
        _sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, **kwargs)
        _sync(device)
        times[n] = time.perf_counter() - start
    return {
        "ttft_ms": times[1] * 1e3,
        "tpot_ms": (times[output_len] - times[1]) / (output_len - 1) * 1e3,
        "output_tokens": output_len,
    }


def _medians(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if k != "output_tokens"]
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def _hf_model(dtype: torch.dtype, device: str):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from gguf_utils import transformers_gguf_model

    model, _ = transformers_gguf_model(default_model_path())
    return model.to(device=device, dtype=dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hf-peer", action="store_true", help="also time transformers")
    parser.add_argument("--out", default=None, help="JSON file to write")
    args = parser.parse_args()

    llm = LLM(
        DEFAULT_MODEL,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=256,
        max_num_seqs=1,
        enable_prefix_caching=False,
    )
    prompt_ids = llm.tokenizer.encode(
        llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]), add_bos=False
    )
    dtype = next(llm.engine.runner.model.parameters()).dtype
    run_pagedd(llm, prompt_ids, 8, args.device)  # warm-up (CUDA graphs, allocator, kernels)
    runs = [run_pagedd(llm, prompt_ids, args.output_len, args.device) for _ in range(args.runs)]
    pagedd = _medians(runs)
    cfg = llm.engine.model_config
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    kv_bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    kv_bytes_per_token *= dtype.itemsize
    mean_context = len(prompt_ids) + args.output_len / 2
    step_bytes = weight_bytes + kv_bytes_per_token * mean_context
    pagedd["achieved_gbs"] = step_bytes / (pagedd["tpot_ms"] * 1e6)
    results = {"pagedd": {**pagedd, "runs": runs}}
    ceiling = None
    if args.device == "cuda":
        from bench.timing import copy_bandwidth_gbs

        ceiling = copy_bandwidth_gbs()["gbs"]
        pagedd["fraction_of_copy_ceiling"] = pagedd["achieved_gbs"] / ceiling
    if args.hf_peer:
        hf = _hf_model(dtype, args.device)
        run_hf(hf, prompt_ids, 8, args.device)
        hf_runs = [run_hf(hf, prompt_ids, args.output_len, args.device) for _ in range(args.runs)]
        results["transformers"] = {**_medians(hf_runs), "runs": hf_runs}

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "commit": commit,
        "command": " ".join(sys.argv),
        "workload": {
            "model": f"{DEFAULT_MODEL} ({default_model_path().name})",
            "dtype": str(dtype).removeprefix("torch."),
            "device": args.device,
            "batch_size": 1,
            "prompt_tokens": len(prompt_ids),
            "output_tokens": args.output_len,
            "runs": args.runs,
            "weight_bytes": weight_bytes,
            "kv_bytes_per_token": kv_bytes_per_token,
        },
        "copy_ceiling_gbs": ceiling,
        "results": results,
    }
    print(f"{'backend':14} {'TTFT ms':>9} {'TPOT ms':>9} {'tok/s':>8} {'GB/s':>8}")
    for name, r in results.items():
        gbs = f"{r['achieved_gbs']:8.1f}" if "achieved_gbs" in r else f"{'':8}"
        print(f"{name:14} {r['ttft_ms']:9.2f} {r['tpot_ms']:9.3f} {1e3 / r['tpot_ms']:8.1f} {gbs}")
    if ceiling:
        print(f"copy ceiling {ceiling:.0f} GB/s: {pagedd['fraction_of_copy_ceiling']:.1%}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
