"""The transformers peers of throughput.py, on a model built from the same config.json:

- ``hf-continuous``: ``model.generate_batch`` (transformers' continuous batching, paged
  attention over sdpa). Its wall time is taken from the requests' own timestamps, from the
  first request created to the last one finished, so its warm-up (CUDA graph capture) is
  not counted, as pagedd's is not; the whole call's time is reported too.
- ``hf-static``: ``model.generate`` on fixed batches (``--static-batch-size``, default 64) in
  workload order, prompts left-padded; every batch runs until its longest output is done.

Weights are random: the model is built from the config with ``torch.manual_seed(seed)`` and
transformers' own initialisation (normal(0, initializer_range)), not pagedd's dummy fill, so
the weights are not identical across backends. That changes no throughput figure: EOS is
ignored and every request generates exactly its output length.
"""

from __future__ import annotations

import inspect
import time

from bench.workloads import WorkloadRequest


def _torch_dtype(torch, name: str | None, device: str):
    if name in (None, "auto"):
        return torch.bfloat16 if device == "cuda" else torch.float32
    return getattr(torch, name)


def load_hf_model(model_dir: str, args, attn_implementation: str = "sdpa"):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    device = (
        "cuda"
        if args.device in (None, "auto") and torch.cuda.is_available()
        else (args.device or "cpu")
    )
    device = "cpu" if device == "auto" else device
    config = AutoConfig.from_pretrained(model_dir)
    dtype = _torch_dtype(torch, args.dtype, device)
    torch.manual_seed(args.seed or 0)
    with torch.device(device):  # build (and initialise) the weights on the device directly
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation
        )
    return model.eval(), device, dtype


def _generation_config(output_len: int, fixed_length: bool):
    from transformers import GenerationConfig

    kwargs = {
        "max_new_tokens": output_len,
        "do_sample": False,
        "pad_token_id": 0,
        "eos_token_id": None,
    }
    if fixed_length:
        kwargs["min_new_tokens"] = output_len
    return GenerationConfig(**kwargs)


def run_hf_continuous(model_dir: str, requests: list[WorkloadRequest], args) -> dict:
    if any(r.is_text for r in requests):
        raise ValueError("the transformers backends take token-id workloads only")
    t_load = time.perf_counter()
    # transformers 5.x before 5.23 spells its paged attention over sdpa "paged|sdpa"
    model, device, dtype = load_hf_model(model_dir, args, attn_implementation="paged|sdpa")
    load_s = time.perf_counter() - t_load
    output_len = max(r.output_len for r in requests)
    if any(r.output_len != output_len for r in requests):
        raise ValueError("hf-continuous takes one output length for every request")
    gen = _generation_config(output_len, fixed_length=False)  # eos None: CB disables EOS
    accepted = inspect.signature(model.generate_batch).parameters
    kwargs = {k: v for k, v in (("progress_bar", not args.no_progress),) if k in accepted}
    start = time.perf_counter()
    results = model.generate_batch(
        [list(r.prompt) for r in requests], generation_config=gen, **kwargs
    )
    call_s = time.perf_counter() - start
    outs = list(results.values())
    failed = [o for o in outs if getattr(o, "error", None)]
    created = [getattr(o, "created_time", None) for o in outs]
    finished = [getattr(o, "lifespan", (-1, -1))[1] for o in outs]
    timed = all(c is not None for c in created) and all(f and f > 0 for f in finished)
    wall_s = (max(finished) - min(created)) if timed and outs else call_s
    return {
        "wall_s": wall_s,
        "wall_s_source": "request timestamps (excludes warm-up)" if timed else "whole call",
        "call_s": call_s,
        "load_s": load_s,
        "num_prompt_tokens": sum(r.prompt_len for r in requests),
        "num_output_tokens": sum(len(o.generated_tokens) for o in outs),
        "num_failed": len(failed) + (len(requests) - len(outs)),
        "engine": _engine_info(model, device, dtype),
    }


def run_hf_static(model_dir: str, requests: list[WorkloadRequest], args) -> dict:
    import torch

    if any(r.is_text for r in requests):
        raise ValueError("the transformers backends take token-id workloads only")
    t_load = time.perf_counter()
    model, device, dtype = load_hf_model(model_dir, args)
    load_s = time.perf_counter() - t_load
    batch_size = args.static_batch_size
    with torch.inference_mode():
        warm = torch.ones((2, 4), dtype=torch.long, device=device)
        model.generate(
            warm,
            attention_mask=torch.ones_like(warm),
            generation_config=_generation_config(2, True),
        )
        if device == "cuda":
            torch.cuda.synchronize()
        num_output = 0
        start = time.perf_counter()
        for i in range(0, len(requests), batch_size):
            batch = requests[i : i + batch_size]
            width = max(r.prompt_len for r in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, r in enumerate(batch):  # left padding
                ids[row, width - r.prompt_len :] = torch.tensor(r.prompt)
                mask[row, width - r.prompt_len :] = 1
            gen = _generation_config(max(r.output_len for r in batch), fixed_length=True)
            out = model.generate(
                ids.to(device), attention_mask=mask.to(device), generation_config=gen
            )
            num_output += (out.shape[1] - width) * len(batch)
        if device == "cuda":
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - start
    return {
        "wall_s": wall_s,
        "load_s": load_s,
        "num_prompt_tokens": sum(r.prompt_len for r in requests),
        "num_output_tokens": num_output,
        "static_batch_size": batch_size,
        "engine": _engine_info(model, device, dtype),
    }


def _engine_info(model, device: str, dtype) -> dict:
    import transformers

    return {
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "transformers": transformers.__version__,
    }
