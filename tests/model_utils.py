"""Test helpers: a tiny reference driver for the model (allocator + metadata by hand),
and tiny Hugging Face models saved with save_pretrained."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from pydaemon.layers.attention_metadata import AttentionMetadata


@dataclass
class Seq:
    token_ids: list[int]
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)


class SimpleAllocator:
    """Hands out block ids from a list (optionally shuffled, so tables are non-sequential)."""

    def __init__(self, num_blocks: int, shuffle_seed: int | None = None) -> None:
        ids = list(range(num_blocks))
        if shuffle_seed is not None:
            g = torch.Generator().manual_seed(shuffle_seed)
            ids = [ids[i] for i in torch.randperm(num_blocks, generator=g).tolist()]
        self.free = ids

    def ensure(self, seq: Seq, num_tokens: int, block_size: int) -> None:
        while len(seq.block_table) * block_size < num_tokens:
            seq.block_table.append(self.free.pop(0))


def build_step(
    seqs: list[Seq], query_lens: list[int], num_prefills: int, block_size: int, device="cpu"
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Inputs for one step in which seqs[i] computes its next query_lens[i] tokens.

    The first ``num_prefills`` sequences are prefills (chunks), the rest decodes.
    """
    input_ids, positions, slots, seq_lens = [], [], [], []
    for seq, q in zip(seqs, query_lens, strict=True):
        start = seq.num_computed_tokens
        for p in range(start, start + q):
            input_ids.append(seq.token_ids[p])
            positions.append(p)
            slots.append(seq.block_table[p // block_size] * block_size + p % block_size)
        seq_lens.append(start + q)
    max_blocks = max(len(s.block_table) for s in seqs)
    tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs]
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    num_prefill_tokens = sum(query_lens[:num_prefills])
    md = AttentionMetadata(
        num_prefills=num_prefills,
        num_prefill_tokens=num_prefill_tokens,
        num_decode_tokens=sum(query_lens) - num_prefill_tokens,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        max_seq_len=max(seq_lens),
        max_query_len=max(query_lens),
        seq_lens_cpu=seq_lens,
        query_lens_cpu=list(query_lens),
    )
    ids = torch.tensor(input_ids, dtype=torch.int64, device=device)
    pos = torch.tensor(positions, dtype=torch.int64, device=device)
    return ids, pos, md


def make_kv_cache(model, num_blocks: int, block_size: int) -> torch.Tensor:
    cfg = model.config
    p = next(model.parameters())
    shape = (num_blocks, cfg.num_hidden_layers, 2, cfg.num_key_value_heads, block_size)
    # Filled with NaN: reading a slot that was never written poisons the output.
    return torch.full((*shape, cfg.head_dim), float("nan"), dtype=p.dtype, device=p.device)


class Driver:
    """Runs greedy generation with a paged KV cache; the schedule is given step by step."""

    def __init__(self, model, block_size: int, num_blocks: int = 256, shuffle_seed=1) -> None:
        self.model = model
        self.block_size = block_size
        self.kv_cache = make_kv_cache(model, num_blocks, block_size)
        self.allocator = SimpleAllocator(num_blocks, shuffle_seed)
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def step(self, seqs: list[Seq], query_lens: list[int], num_prefills: int) -> None:
        """Computes the given tokens; appends a greedy token to each sequence whose query
        reaches the end of its known tokens."""
        for seq, q in zip(seqs, query_lens, strict=True):
            self.allocator.ensure(seq, seq.num_computed_tokens + q, self.block_size)
        ids, pos, md = build_step(seqs, query_lens, num_prefills, self.block_size, self.device)
        hidden = self.model(ids, pos, self.kv_cache, md)
        last = torch.tensor(md.query_start_loc[1:].tolist(), device=self.device) - 1
        next_tokens = self.model.compute_logits(hidden[last]).argmax(-1).tolist()
        for seq, q, tok in zip(seqs, query_lens, next_tokens, strict=True):
            seq.num_computed_tokens += q
            if seq.num_computed_tokens == len(seq.token_ids):
                seq.token_ids.append(tok)

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Prefill all prompts in one mixed step, then decode all together."""
        seqs = [Seq(list(p)) for p in prompts]
        self.step(seqs, [len(p) for p in prompts], num_prefills=len(seqs))
        for _ in range(max_new_tokens - 1):
            self.step(seqs, [1] * len(seqs), num_prefills=0)
        return [s.token_ids[len(p) :] for s, p in zip(seqs, prompts, strict=True)]


def save_hf_model(tmp_path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Saves a tiny random transformers model (float32) and returns its directory."""
    import transformers

    kw = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,
    )
    kw.update(overrides)
    if arch == "llama":
        config = transformers.LlamaConfig(**kw)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**kw)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "mistral":
        kw.setdefault("sliding_window", None)
        config = transformers.MistralConfig(**kw)
        cls = transformers.MistralForCausalLM
    elif arch == "qwen3":
        kw.setdefault("head_dim", 32)  # not hidden_size / num_heads, as in real Qwen3 configs
        config = transformers.Qwen3Config(**kw)
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    # Biases are zero- and q/k norms one-initialised: make them matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1.0, 0.3)
    out = tmp_path / f"{arch}-{seed}"
    model.save_pretrained(out, safe_serialization=True)
    return out


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy generate, one prompt at a time, never stopping early."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
            )
        outs.append(out[0, len(prompt) :].tolist())
    return outs


def run_engine(engine, prompts: list[list[int]], params, on_step=None) -> list[list[int]]:
    """Every prompt through ``engine`` (an LLMEngine) to the end: the first output's token
    ids per prompt, in order. ``on_step(engine)`` runs after each step; at the end every KV
    block must be free again."""
    from pydaemon.generate_request import GenerateRequest

    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(str(i), list(p), params))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] = out.get(o.request_id, []) + o.outputs[0].token_ids
        if on_step is not None:
            on_step(engine)
    stats = engine.get_stats()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    return [out[str(i)] for i in range(len(prompts))]
