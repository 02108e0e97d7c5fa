"""KV tiers on a multi-turn chat workload whose conversations need several times the GPU KV
cache: TTFT (p50/p90), TPOT, throughput and prefix-cache hits by tier, one engine and one
setting per process, in process (offline). ``--workload chat`` (short chats sharing system
prompts) or ``document`` (each conversation over a long document of its own). pagedd's rows
break TTFT down (queue and prefill p50 from the engine's own timestamps, the cached fraction
of first and later turns' prompts) and give first turns' TTFT apart: after a restart with a
disk tier, only that tier can serve a first turn.

  python bench/bench_kv_tiers.py --engine pagedd --model-config llama3-8b --num-gpu-blocks 2048
  python bench/bench_kv_tiers.py --engine pagedd ... --kv-offloading-size 32     # the CPU tier
  PYTHONPATH=VLLM_SITE python bench/bench_kv_tiers.py --engine vllm ... --kv-offloading-size 32
  python bench/bench_kv_tiers.py --compare OUT/*.json                             # the table

Both engines get the same prompts (bench/chat_workload.py, token ids, greedy, EOS ignored), the
same GPU KV size (pagedd's --num-kv-blocks, vLLM's num_gpu_blocks_override) and the same CPU
tier size (vLLM: --kv-offloading-backend native --kv-offloading-size, GiB over all ranks, as
pagedd's). The driver is bench/closed_loop.py: conversations take turns round robin with at
most --max-active requests in flight. Hit rates are prompt tokens served by each tier over the
prompt tokens looked up (pagedd's counters; vLLM's prefix-cache and external prefix-cache
counters when its engine reports them). Results: JSON (--out) and a short table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.chat_workload import ChatWorkload, long_document_chat, multi_turn_chat  # noqa: E402
from bench.closed_loop import run_closed_loop  # noqa: E402
from bench.loadgen_env import environment, write_json  # noqa: E402
from bench.throughput_models import MODEL_CONFIGS, write_model_config  # noqa: E402

_WARMUP_TOKEN = 30001  # outside the workload's token ids: the warm-up leaves no usable prefix


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_kv_tiers", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("pagedd", "vllm"), default="pagedd")
    p.add_argument("--label", default=None, help="the row's name (default: engine and tiers)")
    m = p.add_argument_group("model")
    m.add_argument("--model", default=None, help="a model directory (config.json at least)")
    m.add_argument("--model-config", choices=sorted(MODEL_CONFIGS), default="llama3-8b",
                   help="write this shape's config.json to a temp dir (dummy weights)")  # fmt: skip
    m.add_argument("--load-format", choices=("auto", "dummy"), default="dummy")
    m.add_argument("--dtype", default="bfloat16")
    m.add_argument("--device", default="cuda")
    e = p.add_argument_group("engine")
    e.add_argument("--num-gpu-blocks", type=int, default=2048,
                   help="GPU KV blocks (the same for both engines)")  # fmt: skip
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--kv-offloading-size", type=float, default=0.0,
                   help="GiB of the CPU tier (0: off)")  # fmt: skip
    e.add_argument("--kv-offloading-dir", default=None, help="pagedd: a disk tier there")
    e.add_argument("--kv-offloading-disk-size", type=float, default=None, help="pagedd: its GiB")
    e.add_argument("--max-num-seqs", type=int, default=None)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--max-model-len", type=int, default=8192)
    w = p.add_argument_group("workload (bench/chat_workload.py)")
    w.add_argument("--workload", choices=("chat", "document"), default="chat",
                   help="chat: short chats sharing system prompts; document: each "
                   "conversation over its own long document")  # fmt: skip
    w.add_argument("--conversations", type=int, default=None, help="default: 48 (chat), 32")
    w.add_argument("--turns", type=int, default=None, help="default: 5 (chat), 4 (document)")
    w.add_argument("--system-len", type=int, default=256, help="chat")
    w.add_argument("--num-system-prompts", type=int, default=4, help="chat")
    w.add_argument("--user-len", default="256,512", help="chat: MIN,MAX tokens of a message")
    w.add_argument("--doc-len", type=int, default=8192, help="document: its tokens")
    w.add_argument("--question-len", default="32,64", help="document: MIN,MAX question tokens")
    w.add_argument("--reply-len", type=int, default=None, help="default: 128 (chat), 200")
    w.add_argument("--max-active", type=int, default=16, help="requests in flight at most")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--token-range", default="100,30000", help="LOW,HIGH synthetic token ids")
    o = p.add_argument_group("output")
    o.add_argument("--out", default=None, help="JSON file of this run")
    o.add_argument("--compare", nargs="+", default=None, metavar="JSON",
                   help="print the table of these result files (the first is the baseline)")  # fmt: skip
    return p


def workload_of(args) -> ChatWorkload:
    token_low, token_high = (int(x) for x in args.token_range.split(","))
    chat = args.workload == "chat"
    conversations = args.conversations or (48 if chat else 32)
    turns = args.turns or (5 if chat else 4)
    reply_len = args.reply_len or (128 if chat else 200)
    if not chat:
        low, high = (int(x) for x in args.question_len.split(","))
        return long_document_chat(
            conversations,
            turns,
            doc_len=args.doc_len,
            question_len=(low, high),
            reply_len=reply_len,
            seed=args.seed,
            token_low=token_low,
            token_high=token_high,
        )
    low, high = (int(x) for x in args.user_len.split(","))
    return multi_turn_chat(
        conversations,
        turns,
        system_len=args.system_len,
        num_system_prompts=args.num_system_prompts,
        user_len=(low, high),
        reply_len=reply_len,
        seed=args.seed,
        token_low=token_low,
        token_high=token_high,
    )


# ---- pagedd -----------------------------------------------------------------------------------
class PageddChat:
    def __init__(self, model: str, args) -> None:
        from pydaemon import LLM

        kwargs = dict(
            device=args.device,
            dtype=args.dtype,
            load_format=args.load_format,
            block_size=args.block_size,
            num_kv_blocks=args.num_gpu_blocks,
            max_model_len=args.max_model_len,
            seed=0,
        )
        for key in ("max_num_seqs", "max_num_batched_tokens", "kv_offloading_dir",
                    "kv_offloading_disk_size"):  # fmt: skip
            if getattr(args, key) is not None:
                kwargs[key] = getattr(args, key)
        if args.kv_offloading_size:
            kwargs.update(
                kv_offloading_size=args.kv_offloading_size, kv_offloading_backend="native"
            )
        self.engine = LLM(model=model, **kwargs).engine
        self.engine.warmup()
        self._num_tokens: dict[str, int] = {}
        self._metrics: dict[str, dict] = {}  # finished requests' breakdowns, until asked for

    def submit(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        from pydaemon import SamplingParams
        from pydaemon.generate_request import GenerateRequest

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self._num_tokens[request_id] = 0
        self.engine.add_request(GenerateRequest(request_id, prompt, params))

    def step(self) -> list[tuple[str, int, bool]]:
        changes = []
        for out in self.engine.step():  # deltas: the new tokens of each request
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id}: {out.error}")
            n = self._num_tokens[out.request_id] + len(out.outputs[0].token_ids)
            self._num_tokens[out.request_id] = n
            changes.append((out.request_id, n, out.finished))
            if out.finished:
                del self._num_tokens[out.request_id]
                self._metrics[out.request_id] = _breakdown(out.metrics)
        return changes

    def request_metrics(self, request_id: str) -> dict | None:
        return self._metrics.pop(request_id, None)

    def counters(self) -> dict:
        stats = self.engine.get_stats()
        tiers = stats.kv_tiers
        out = {
            "query_tokens": stats.prefix_cache_query_tokens,
            "preemptions": stats.num_preemptions,
        }
        if tiers is None:
            out["gpu_hit_tokens"] = stats.prefix_cache_hit_tokens
            return out
        for key in ("gpu_hit_tokens", "cpu_hit_tokens", "disk_hit_tokens", "gpu_to_cpu_bytes",
                    "cpu_to_gpu_bytes", "cpu_to_disk_bytes", "disk_to_cpu_bytes"):  # fmt: skip
            out[key] = getattr(tiers, key)
        return out

    def close(self) -> None:
        self.engine.shutdown()


def _breakdown(m) -> dict | None:
    """pagedd's RequestMetrics -> the closed loop's breakdown (None when not reported)."""
    if m is None or m.first_scheduled_time is None or m.first_token_time is None:
        return None
    return {
        "queue_s": m.first_scheduled_time - m.arrival_time,
        "prefill_s": m.first_token_time - m.first_scheduled_time,
        "cached_tokens": m.num_cached_tokens,
    }


# ---- vLLM -------------------------------------------------------------------------------------
class VllmChat:
    """vLLM's in-process engine (``LLMEngine``), stepped by the same driver; token ids in, no
    tokenizer (``skip_tokenizer_init``), everything not set here at vLLM's defaults."""

    def __init__(self, model: str, args) -> None:
        from vllm import EngineArgs, LLMEngine

        kwargs = dict(
            model=model,
            skip_tokenizer_init=True,
            load_format=args.load_format,
            dtype=args.dtype,
            block_size=args.block_size,
            num_gpu_blocks_override=args.num_gpu_blocks,
            max_model_len=args.max_model_len,
            enable_prefix_caching=True,
            disable_log_stats=False,  # its prefix-cache counters
            seed=0,
        )
        for key in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(args, key) is not None:
                kwargs[key] = getattr(args, key)
        if args.kv_offloading_size:
            kwargs.update(
                kv_offloading_backend="native", kv_offloading_size=args.kv_offloading_size
            )
        self.engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
        warm = [[_WARMUP_TOKEN + i] * 32 for i in range(8)]
        for i, prompt in enumerate(warm):
            self.submit(f"warmup-{i}", prompt, 4)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        self.engine.reset_prefix_cache()
        self.baseline = self.counters()

    def submit(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        from vllm import SamplingParams

        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
        )
        self.engine.add_request(request_id, {"prompt_token_ids": prompt}, params)

    def request_metrics(self, request_id: str) -> dict | None:
        return None  # its per-request stats are not the same clock's: TTFT only

    def step(self) -> list[tuple[str, int, bool]]:
        # Cumulative outputs (vLLM's default output kind).
        return [(o.request_id, len(o.outputs[0].token_ids), o.finished) for o in self.engine.step()]

    def counters(self) -> dict:
        """vLLM's counters by name, when its engine reports them (else empty)."""
        try:
            metrics = self.engine.get_metrics()
        except Exception:  # noqa: BLE001 - not every version has it: the figures say None
            return {}
        names = {
            "vllm:prefix_cache_queries": "query_tokens",
            "vllm:prefix_cache_hits": "gpu_hit_tokens",
            "vllm:external_prefix_cache_hits": "cpu_hit_tokens",
            "vllm:num_preemptions": "preemptions",
        }
        out: dict = {}
        for metric in metrics:
            key = names.get(getattr(metric, "name", ""))
            value = getattr(metric, "value", None)
            if key is not None and isinstance(value, int | float):
                out[key] = out.get(key, 0) + value
        return out

    def close(self) -> None:
        pass


# ---- the run ----------------------------------------------------------------------------------
def hit_rates(before: dict, after: dict) -> dict:
    delta = {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], int | float)}
    queries = delta.get("query_tokens")
    rates = {}
    for tier in ("gpu", "cpu", "disk"):
        hits = delta.get(f"{tier}_hit_tokens")
        rates[f"{tier}_hit_rate"] = hits / queries if queries and hits is not None else None
    return {"counters": delta, **rates}


def run(args) -> dict:
    model = args.model or str(write_model_config(args.model_config))
    workload = workload_of(args)
    t_load = time.perf_counter()
    engine = PageddChat(model, args) if args.engine == "pagedd" else VllmChat(model, args)
    load_s = time.perf_counter() - t_load
    before = engine.counters()
    result = run_closed_loop(engine, workload, args.max_active)
    after = engine.counters()
    engine.close()
    tiers = "off" if not args.kv_offloading_size else f"cpu {args.kv_offloading_size:g} GiB"
    if args.kv_offloading_dir:
        tiers += f" + disk {args.kv_offloading_disk_size:g} GiB"
    return {
        "label": args.label or f"{args.engine}, {args.workload}, tiers {tiers}",
        "engine": args.engine,
        "environment": environment(),
        "args": vars(args),
        "workload": workload.summary(),
        "load_s": load_s,
        "figures": result.figures(),
        "hits": hit_rates(before, after) if after else None,
    }


def _fmt(value, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def table(results: list[dict]) -> str:
    base = results[0]["figures"]
    head = ("run", "TTFT p50 ms", "p90 ms", "1st turns", "queue", "prefill", "TPOT p50 ms",
            "out tok/s", "TTFT p50 base/run", "tok/s run/base", "hit gpu", "cpu", "disk")  # fmt: skip
    rows = [head]
    for r in results:
        f, hits = r["figures"], r.get("hits") or {}
        rows.append((
            r["label"], _fmt(f["ttft_p50_s"], 1e3), _fmt(f["ttft_p90_s"], 1e3),
            _fmt(f.get("ttft_first_turns_p50_s"), 1e3), _fmt(f.get("queue_p50_s"), 1e3),
            _fmt(f.get("prefill_p50_s"), 1e3), _fmt(f["tpot_p50_s"], 1e3, 2), _fmt(f["output_tokens_per_s"], 1, 0),
            _fmt(base["ttft_p50_s"] / f["ttft_p50_s"], 1, 2),
            _fmt(f["output_tokens_per_s"] / base["output_tokens_per_s"], 1, 3),
            _fmt(hits.get("gpu_hit_rate"), 1, 3), _fmt(hits.get("cpu_hit_rate"), 1, 3),
            _fmt(hits.get("disk_hit_rate"), 1, 3),
        ))  # fmt: skip
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    return "\n".join(
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.compare:
        print(table([json.loads(Path(p).read_text()) for p in args.compare]))
        return 0
    result = run(args)
    if args.out:
        write_json(args.out, result)
    print(json.dumps({"workload": result["workload"], "load_s": round(result["load_s"], 1)}))
    print(table([result]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
