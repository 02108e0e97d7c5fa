"""The sizes a GGUF file's metadata builds a model from, bounded by the tensors present: a
hostile value fails with a ValueError naming the ``{arch}.*`` key before any layer is built
(``block_count`` 1e7 built ten million layers on the meta device for minutes; 0 heads divided
by zero; a feed-forward of 1e9 would have been allocated before its weights were read).
"""

from __future__ import annotations

import re

from pydaemon.gguf.reader import GGUFFile

MAX_CONTEXT_LENGTH = 1 << 24  # positions (Llama 4 Scout's is 10M)
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.([a-z_]+)\.weight")


def check_counts(f: GGUFFile) -> None:
    """ValueError naming the ``{arch}.*`` key unless each size the model is built from is a
    positive integer that the tensors present agree with."""
    arch, name = f.architecture, f.path.name

    def count(key: str) -> int | None:
        value = f.get(f"{arch}.{key}")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{name}: {arch}.{key} must be one integer (got {value!r})")
        if value is not None and value < 1:
            raise ValueError(f"{name}: {arch}.{key} must be at least 1 (got {value})")
        return value

    def must_match(what: str, value: int | None, tensor: str | None, dim: int, unit: str) -> None:
        """``value`` (``what``) must be dimension ``dim`` of ``tensor`` when both exist."""
        if value is None or tensor is None or f.shape(tensor)[dim] == value:
            return
        raise ValueError(
            f"{name}: {what} is {value}, but {tensor} has {f.shape(tensor)[dim]} {unit}"
        )

    if not f.has_tensor("token_embd.weight") or len(f.shape("token_embd.weight")) != 2:
        raise ValueError(f"{name} has no 2D tensor token_embd.weight (the token embeddings)")
    num_rows, width = f.shape("token_embd.weight")
    first_of: dict[str, str] = {}  # a layer tensor's kind -> its name in the first layer
    layers: set[int] = set()
    for tensor in f.tensors:
        match = _LAYER_TENSOR.fullmatch(tensor)
        if match is not None:
            layers.add(int(match[1]))
            first_of.setdefault(match[2], tensor)
    num_layers = count("block_count") or 0
    # more layers than the file has tensors for: one of the first len(layers) + 1 is missing
    missing = next((i for i in range(min(num_layers, len(layers) + 1)) if i not in layers), None)
    if missing is not None:
        raise ValueError(
            f"{name}: {arch}.block_count is {num_layers}, but the file has no tensors for "
            f"layer {missing} (it has tensors for {len(layers)} layers)"
        )
    hidden = count("embedding_length")
    must_match(f"{arch}.embedding_length", hidden, "token_embd.weight", 1, "columns")
    for key, most, what in (
        ("vocab_size", num_rows, "the rows of token_embd.weight"),
        ("context_length", MAX_CONTEXT_LENGTH, "the most pagedd serves"),
    ):
        value = count(key)
        if value is not None and value > most:
            raise ValueError(f"{name}: {arch}.{key} is {value}, more than {most} ({what})")
    heads = count("attention.head_count")
    if heads is not None:
        head_dim = count("attention.key_length") or (hidden or width) // heads
        if head_dim < 1:
            raise ValueError(
                f"{name}: {arch}.attention.head_count is {heads}, more than "
                f"{arch}.embedding_length ({hidden or width}): no head would have a dimension"
            )
        for key, tensor in (("head_count", "attn_q"), ("head_count_kv", "attn_k")):
            num = count(f"attention.{key}") or heads
            what = f"{arch}.attention.{key} x the head dimension ({num} x {head_dim})"
            must_match(what, num * head_dim, first_of.get(tensor), 0, "rows")
    experts = first_of.get("ffn_up_exps")  # [experts, rows, hidden]
    for key, tensor, dim, unit in (
        ("feed_forward_length", first_of.get("ffn_up"), 0, "rows"),
        ("expert_count", experts, 0, "experts"),
        ("expert_feed_forward_length", experts, 1, "rows"),
        ("expert_shared_feed_forward_length", first_of.get("ffn_up_shexp"), 0, "rows"),
    ):
        must_match(f"{arch}.{key}", count(key), tensor, dim, unit)
    num_used, num_experts = count("expert_used_count"), count("expert_count")
    if num_used is not None and num_used > (num_experts or 0):
        raise ValueError(
            f"{name}: {arch}.expert_used_count is {num_used}, more than {arch}.expert_count "
            f"({num_experts})"
        )
    # A size no tensor pins down (its tensor absent) is still bounded by the largest one.
    largest = max(d for t in f.tensors for d in f.shape(t))
    for key in (
        "feed_forward_length",
        "expert_feed_forward_length",
        "expert_shared_feed_forward_length",
        "attention.key_length",
        "attention.value_length",
        "expert_count",
    ):
        value = count(key)
        if value is not None and value > largest:
            raise ValueError(
                f"{name}: {arch}.{key} is {value}, larger than any dimension of the file's "
                f"tensors ({largest})"
            )
