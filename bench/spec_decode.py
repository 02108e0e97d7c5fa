"""Speculative decoding: time per output token with and without drafts.

Two workloads:

- ``oracle`` (the mechanism's ceiling): the Llama-3-8B shape with dummy weights, bf16; a plain
  engine (CUDA graphs) decodes ``--batches`` requests greedily and its tokens become the
  references of the drafts an engine with speculation verifies (one engine per k in
  ``--ks``: verify CUDA graphs are captured for the configured k). By default
  (``--oracle-accept-all``) every step drafts k tokens and verification keeps them all
  (bench/spec_forced.py: benchmark-only hooks no configuration can select), so every step
  has exactly a perfect oracle's shape, k + 1 tokens verified and kept per sequence; the
  steps, drafts and verify-graph replays are reported so that this can be checked. With
  ``--no-oracle-accept-all`` an OracleProposer drafts the reference and the real rejection
  sampler decides: random weights make near-ties that the decode and prefill kernels round
  differently, so the outputs part after a few tokens and drafting stops (the honest
  acceptance is reported, not assumed).
- ``ngram``: the default model (real SmolLM2-135M-Instruct weights) on a copy-heavy workload
  (chat messages, rendered by the model's template as the OpenAI API does, that ask to repeat
  or lightly edit a passage they quote; each request ends at its end-of-turn token or at
  ``--output-len``), n-gram drafts against no speculation, batch 1 and 32: acceptance rate
  and speed-up. Each k runs with the governor off (``ngram_kK``: every step up to the batch
  drafts, the mechanism's cost) and on (``ngram_kK_auto``, the default: speculation turns
  itself off where it measures slower, pydaemon/core/sched/spec_governor.py; its engine keeps
  what it learned from run to run, as a server does).
- ``eagle``: the EAGLE-1 proposer (``method: "eagle"``) on the oracle workload's prompts.
  By default the Llama-3-8B shape with dummy weights and a dummy one-layer head of the
  EAGLE-LLaMA3-Instruct-8B shape: acceptance is ~0, so the figures are the cost of running
  the head (catching up after every forward, k drafting passes) and of verifying; with
  ``--model`` a real target and ``--eagle-head`` its real head, the honest speed-up.

Per configuration and batch: one warm-up, then ``--runs`` runs, alternating with the plain
engine (whose TPOT is the median over all of its runs); each
run submits the whole batch at once and steps the in-process engine. TPOT per request =
(latency - TTFT) / (output tokens - 1), as bench/tpot_batch1.py; reported: the median over
requests and runs, output tokens/s, the spec-decode counters, and TPOT ratios against the
plain engine measured in the same call.

    PYTHONPATH=. python bench/spec_decode.py --workload oracle \\
        --out bench/results/spec_decode_oracle_h200_<date>.json
    PYTHONPATH=. python bench/spec_decode.py --workload ngram --batches 1,32 \\
        --out bench/results/spec_decode_ngram_h200_<date>.json
    PYTHONPATH=. python bench/spec_decode.py --workload eagle --batches 1,8 --ks 3 \\
        --out bench/results/spec_decode_eagle_dummy_h200_<date>.json
    PYTHONPATH=. python bench/spec_decode.py --workload oracle --model demo --device cpu \\
        --dtype float32 --batches 1,2 --ks 2 --output-len 8 --prompt-len 16 --runs 1
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
from bench.spec_forced import AcceptAllRejectionSampler, ForcedOracleProposer  # noqa: E402
from bench.throughput_models import write_model_config  # noqa: E402
from pydaemon.generate_request import GenerateRequest

PASSAGES = (
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion, the members agreed to increase funding for the public library by ten "
    "percent, to repair the bridge on Mill Street before winter, and to postpone the new "
    "community centre until the next fiscal year.",
    "To install the package, download the archive, unpack it into a folder of your choice, "
    "and run the setup script from that folder. The script checks your Python version, "
    "installs the dependencies, and writes a configuration file to your home directory.",
    "Photosynthesis is the process by which green plants use sunlight to turn water and "
    "carbon dioxide into glucose and oxygen. It takes place mainly in the leaves, inside "
    "small structures called chloroplasts, which contain the green pigment chlorophyll.",
    "Dear customer, thank you for your order. Your parcel left our warehouse this morning "
    "and should arrive within three to five working days. You can follow its progress with "
    "the tracking number printed on your receipt.",
)
INSTRUCTIONS = (
    "Repeat the following text exactly, word for word.",
    "Copy the text below, replacing every full stop with an exclamation mark.",
    "Rewrite the following text without changing any word.",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spec_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=("oracle", "ngram", "eagle"), default="oracle")
    p.add_argument("--model", default=None,
                   help="oracle: default a temp dir with the llama3-8b config (dummy weights); "
                        "ngram: default the SmolLM2 default model")  # fmt: skip
    p.add_argument("--eagle-head", default=None,
                   help="eagle workload: the head's directory (default: a dummy Llama-3-8B "
                   "head)")  # fmt: skip
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes")
    p.add_argument("--ks", default="2,4,8", help="comma-separated num_speculative_tokens")
    p.add_argument("--prompt-len", type=int, default=1024, help="oracle workload")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--num-kv-blocks", type=int, default=6144, help="per engine")
    p.add_argument("--oracle-accept-all", action=argparse.BooleanOptionalAction, default=None,
                   help="oracle workload (default on there): every step drafts k tokens and "
                        "verification keeps them all (bench/spec_forced.py), so each step has "
                        "a perfect oracle's shape; off: the OracleProposer and the real "
                        "acceptance, which random weights make diverge")  # fmt: skip
    p.add_argument("--governor", default=None,
                   help="comma-separated off,on: speculating engines per k without / with the "
                        "governor (auto_disable; default: off,on for ngram, off otherwise)")  # fmt: skip
    p.add_argument("--out", default=None, help="JSON file to write")
    return p


def run_batch(
    llm, prompts: list[list[int]], output_len: int, device: str, ignore_eos: bool = True
) -> dict:
    import torch

    from pydaemon import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=ignore_eos)
    engine = llm.engine
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerateRequest(f"r{i}", list(prompt), params))
    times: dict[str, list[float]] = {f"r{i}": [] for i in range(len(prompts))}
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    num_steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        num_steps += 1
        now = time.perf_counter()
        for out in outputs:
            new = list(out.outputs[0].token_ids) if out.outputs else []
            tokens[out.request_id].extend(new)
            times[out.request_id].extend([now] * len(new))
    end = time.perf_counter()
    tpots = [(t[-1] - t[0]) / max(1, len(t) - 1) * 1e3 for t in times.values() if len(t) > 1]
    total = sum(len(t) for t in tokens.values())
    return {
        "tpot_ms": statistics.median(tpots),
        "ttft_ms": statistics.median(t[0] - start for t in times.values()) * 1e3,
        "output_tokens_per_s": total / (end - start),
        "num_steps": num_steps,
        "tokens": [tokens[f"r{i}"] for i in range(len(prompts))],
    }


def _spec_counters(llm) -> dict:
    stats = llm.engine.core.get_stats().spec_decode
    return {
        "num_drafts": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "accepted_per_position": list(stats.accepted_per_position),
    }


def _delta(after: dict, before: dict) -> dict:
    out = {
        k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    }
    out["acceptance_rate"] = out["num_accepted_tokens"] / max(1, out["num_draft_tokens"])
    out["mean_accepted_per_step"] = out["num_accepted_tokens"] / max(1, out["num_drafts"])
    return out


def _prompts(args, llm, batch: int) -> list[list[int]]:
    if args.workload in ("oracle", "eagle"):
        vocab = llm.engine.model_config.vocab_size
        rng = random.Random(batch)
        return [[rng.randrange(100, min(30000, vocab)) for _ in range(args.prompt_len)]
                for _ in range(batch)]  # fmt: skip
    from pydaemon.tokenizer.chat_encoding import encode_chat

    prompts = []
    for i in range(batch):
        instruction = INSTRUCTIONS[i % len(INSTRUCTIONS)]
        passage = PASSAGES[(i // len(INSTRUCTIONS)) % len(PASSAGES)]
        message = {"role": "user", "content": f"{instruction}\n\nText: {passage}"}
        prompts.append(encode_chat(llm.tokenizer, [message])[1])
    return prompts


def _install(llm, args, prompts, reference, k: int) -> None:
    """The oracle workload's drafting on a spec engine's runner (benchmark-only hooks)."""
    from pydaemon.worker.spec_decode.oracle_proposer import OracleProposer
    from pydaemon.worker.spec_decode.rejection_sampler import RejectionSampler

    decoder = llm.engine.runner.spec_decoder
    if args.oracle_accept_all:
        decoder.proposer = ForcedOracleProposer(prompts, reference["tokens"], max_drafts=k)
        decoder.rejection_sampler = AcceptAllRejectionSampler()
    else:
        full = [p + t for p, t in zip(prompts, reference["tokens"], strict=True)]
        decoder.proposer = OracleProposer(full, max_drafts=k)
        decoder.rejection_sampler = RejectionSampler()


def _dummy_eagle_head(model_dir: Path) -> Path:
    """A head config beside the target's (its shape, one layer: EAGLE-LLaMA3-Instruct-8B's);
    load_format dummy fills its weights."""
    import json
    import tempfile

    config = json.loads((model_dir / "config.json").read_text())
    head = Path(tempfile.mkdtemp(prefix="pagedd-eagle-head-"))
    (head / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    return head


def _graph_replays(llm) -> tuple[int, int]:
    """(replays, of which verify graphs) so far; (0, 0) without graphs."""
    graphs = llm.engine.runner.cuda_graphs
    return (0, 0) if graphs is None else (graphs.num_replays, graphs.num_verify_replays)


def _free_device_memory() -> None:
    """After the last reference to a shut-down engine is gone: its weights, cache and graphs
    back to the device before the next engine sizes itself."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.oracle_accept_all is None:
        args.oracle_accept_all = args.workload == "oracle"
    if args.oracle_accept_all and args.workload != "oracle":
        raise SystemExit("--oracle-accept-all is for the oracle workload")
    batches = [int(b) for b in args.batches.split(",")]
    eos = args.workload != "ngram"  # ignore_eos: copy requests end at their end-of-turn
    governor = (args.governor or ("off,on" if args.workload == "ngram" else "off")).split(",")
    if not set(governor) <= {"off", "on"}:
        raise SystemExit(f"--governor: off and/or on, got {args.governor!r}")
    ks = [int(k) for k in args.ks.split(",")]
    from pydaemon import LLM

    common = dict(device=args.device, dtype=args.dtype, num_kv_blocks=args.num_kv_blocks,
                  max_num_seqs=max(batches), enable_prefix_caching=False, swap_space=0.5,
                  seed=0)  # fmt: skip
    if args.workload in ("oracle", "eagle") and args.model is None:
        args.model = str(write_model_config("llama3-8b"))
        common["load_format"] = "dummy"
        if args.workload == "eagle" and args.eagle_head is None:
            args.eagle_head = str(_dummy_eagle_head(Path(args.model)))
    elif args.workload == "oracle" and args.model != "demo":
        common["load_format"] = "dummy"
    elif args.model is None:
        from pydaemon.config.engine import DEFAULT_MODEL

        args.model = DEFAULT_MODEL
    plain = LLM(args.model, **common)
    inputs = {}
    for batch in batches:  # the references (greedy outputs), also a warm-up of plain
        prompts = _prompts(args, plain, batch)
        inputs[batch] = (prompts, run_batch(plain, prompts, args.output_len, args.device, eos))
    prefix = args.workload
    runs: dict[int, dict[str, list[dict]]] = {b: {"plain": []} for b in batches}
    for k, auto in ((k, auto) for k in ks for auto in governor):
        # One engine per k: verify CUDA graphs are captured for the configured k only.
        spec = {"method": "ngram", "num_speculative_tokens": k,
                "disable_by_batch_size": max(batches), "auto_disable": auto == "on"}  # fmt: skip
        if args.workload == "eagle":
            spec.update(method="eagle", model=args.eagle_head)
        llm = LLM(args.model, speculative_config=spec, **common)
        name = f"{prefix}_k{k}" + ("_auto" if auto == "on" else "")
        for batch in batches:
            prompts, reference = inputs[batch]
            runs[batch][name] = []
            if args.workload == "oracle":
                _install(llm, args, prompts, reference, k)
            run_batch(llm, prompts, min(8, args.output_len), args.device, eos)  # warm-up
            for _ in range(args.runs):  # alternating engines
                runs[batch]["plain"].append(
                    _summary(run_batch(plain, prompts, args.output_len, args.device, eos))
                )
                before, replays = _spec_counters(llm), _graph_replays(llm)
                run = run_batch(llm, prompts, args.output_len, args.device, eos)
                run["governor"] = llm.engine.core.scheduler.drafts.governor.describe()
                run["spec"] = _delta(_spec_counters(llm), before)
                after = _graph_replays(llm)
                run["graph_replays"] = after[0] - replays[0]
                run["verify_graph_replays"] = after[1] - replays[1]
                run["same_tokens_fraction"] = (
                    sum(a == b for a, b in zip(run["tokens"], reference["tokens"], strict=True))
                    / batch
                )
                runs[batch][name].append(_summary(run))
        llm.engine.shutdown()
        del llm  # one speculating engine at a time beside the plain one
        _free_device_memory()
    results = {str(batch): _table(batch, runs[batch]) for batch in batches}
    report = {
        "meta": {
            **environment(["bench/spec_decode.py", *(argv or sys.argv[1:])]),
            "benchmark": "spec_decode",
        },  # fmt: skip
        "workload": {
            "kind": args.workload,
            "model": args.model,
            "dtype": args.dtype,
            "batches": batches,
            "ks": ks,
            "eagle_head": args.eagle_head,
            "prompt_tokens": args.prompt_len if args.workload != "ngram" else "copy prompts",
            "output_tokens": args.output_len,
            "runs": args.runs,
            "oracle_accept_all": args.oracle_accept_all,
            "notes": "one speculating engine per k (verify CUDA graphs are captured for the "
            "configured k); oracle_accept_all: every step drafts k tokens and keeps them all "
            "(bench/spec_forced.py), so acceptance is 1 by construction and the figures are "
            "a perfect oracle's step shapes; disable_by_batch_size is the largest batch, so "
            "every step of a speculating engine without the governor (auto_disable off) can "
            "draft and runs synchronously (async scheduling overlaps only steps without "
            "drafts); the plain engine overlaps all; _auto: the governor on (it keeps what it "
            "learned across the runs of its engine; each run's 'governor' is its state after); "
            "ngram requests end at their end-of-turn token (the same tokens in both engines)",
        },
        "results": results,
    }
    if args.out:
        write_json(Path(args.out), report)
        print(f"wrote {args.out}", file=sys.stderr)
    plain.engine.shutdown()
    return 0


def _summary(run: dict) -> dict:
    """A run without its tokens, plus its step count."""
    return {key: v for key, v in run.items() if key != "tokens"}


def _table(batch: int, runs: dict[str, list[dict]]) -> dict:
    """Medians per configuration, printed as a table; -> the batch's JSON row."""
    row = {}
    for name, name_runs in runs.items():
        med = {key: statistics.median(r[key] for r in name_runs)
               for key in ("tpot_ms", "ttft_ms", "output_tokens_per_s", "num_steps")}  # fmt: skip
        if name != "plain":
            for key in ("acceptance_rate", "mean_accepted_per_step", "num_drafts",
                        "num_draft_tokens"):  # fmt: skip
                med[key] = statistics.median(r["spec"][key] for r in name_runs)
            for key in ("graph_replays", "verify_graph_replays"):
                med[key] = statistics.median(r[key] for r in name_runs)
        row[name] = {**med, "runs": name_runs}
    for name in row:
        row[name]["speedup_tpot_vs_plain"] = row["plain"]["tpot_ms"] / row[name]["tpot_ms"]
    print(f"batch {batch}")
    print(f"  {'config':14} {'TPOT ms':>9} {'speed-up':>9} {'accept':>7} {'tok/s':>9} "
          f"{'steps':>6} {'drafts':>7} {'verify graphs':>13}")  # fmt: skip
    for name, r in row.items():
        accept = r.get("acceptance_rate")
        accept_s = "-" if accept is None else f"{accept:.2f}"
        drafts = r.get("num_drafts", "-")
        graphs = r.get("verify_graph_replays", "-")
        print(f"  {name:14} {r['tpot_ms']:9.3f} {r['speedup_tpot_vs_plain']:8.2f}x "
              f"{accept_s:>7} {r['output_tokens_per_s']:9.1f} {r['num_steps']:>6} "
              f"{drafts:>7} {graphs:>13}")  # fmt: skip
    return row


if __name__ == "__main__":
    raise SystemExit(main())
