"""Hostile GGUF files (issue 55, 11): every count is bounded by the file's size and the
tensors present, so each file fails at once with a ValueError naming the field: no traceback,
no hang, no growing heap (a block_count of 1e7 or a 3M-piece vocabulary grew memory for
minutes; counts of 2**62, a 40-byte file and 0 heads ended in raw tracebacks)."""

from __future__ import annotations

import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from pydaemon.gguf import GGUFFile
from pydaemon.gguf.bounds import MAX_ARRAY_LEN
from pydaemon.model_loader.model_paths import load_model_config
from pydaemon.tokenizer.gguf import load_gguf_tokenizer

TOKENS_KEY = b"tokenizer.ggml.tokens"


def _write(path: Path, *, tokens: int = 3, uint32: dict | None = None, ffn_rows: int = 64,
           q_rows: int = 32) -> Path:  # fmt: skip
    """A minimal llama file: 1 layer, hidden 32, 2 heads, 4 embedding rows; ``uint32``
    overrides metadata."""
    meta = {"llama.block_count": 1, "llama.embedding_length": 32,
            "llama.attention.head_count": 2, "llama.feed_forward_length": 64,
            **(uint32 or {})}  # fmt: skip
    writer = GGUFWriter(str(path), "llama")
    for key, value in meta.items():
        writer.add_uint32(key, value) if value < 2**32 else writer.add_uint64(key, value)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(["a", "b", "ab", *(f"t{i}" for i in range(tokens - 3))])
    writer.add_token_merges(["a b"])
    writer.add_tensor("token_embd.weight", np.ones((4, 32), dtype=np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(32, dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.ones((q_rows, 32), dtype=np.float32))
    writer.add_tensor("blk.0.ffn_up.weight", np.ones((ffn_rows, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _patched(path: Path, at: int, fmt: str, value: int) -> Path:
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, at, value)
    out = path.with_name(f"patched-{at}.gguf")
    out.write_bytes(bytes(data))
    return out


def _tokens_at(path: Path) -> int:
    """The offset of the token array's length (after its key, its type and its item type)."""
    return path.read_bytes().index(TOKENS_KEY) + len(TOKENS_KEY) + 8


def _tensor_dim_at(path: Path, name: bytes) -> int:
    """The offset of a tensor's first dimension (after its name and its number of dims)."""
    return path.read_bytes().index(name) + len(name) + 4


def _hostile(tmp_path: Path, case: str) -> Path:
    ok = _write(tmp_path / "ok.gguf")
    if case == "forty_bytes":
        (tmp_path / "forty.gguf").write_bytes(ok.read_bytes()[:40])
        return tmp_path / "forty.gguf"
    if case == "truncated":
        (tmp_path / "cut.gguf").write_bytes(ok.read_bytes()[:-100])
        return tmp_path / "cut.gguf"
    if case == "tensor_count":
        return _patched(ok, 8, "<Q", 2**62)
    if case == "kv_count":
        return _patched(ok, 16, "<Q", 2**62)
    if case == "array_length":
        return _patched(ok, _tokens_at(ok), "<Q", 2**62)
    if case == "string_length":  # the first token's
        return _patched(ok, _tokens_at(ok) + 8, "<Q", 2**62)
    if case == "three_million_pieces":
        return _patched(ok, _tokens_at(ok), "<Q", 3_000_000)
    if case == "tensor_dim":
        return _patched(ok, _tensor_dim_at(ok, b"token_embd.weight"), "<Q", 2**62)
    if case == "more_pieces_than_rows":
        return _write(tmp_path / "vocab.gguf", tokens=8)
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case, words",
    [
        ("forty_bytes", "GGUF.kv_count is"),
        ("truncated", "'blk.0.ffn_up.weight' (dimensions [32, 64]"),
        ("tensor_count", "GGUF.tensor_count is 4611686018427387904"),
        ("kv_count", "GGUF.kv_count is 4611686018427387904"),
        ("array_length", "the length of tokenizer.ggml.tokens is 4611686018427387904"),
        ("string_length", "tokenizer.ggml.tokens[0] has a length of 4611686018427387904"),
        ("three_million_pieces", f"tokenizer.ggml.tokens is 3000000, more than {MAX_ARRAY_LEN}"),
        ("tensor_dim", "tensor 'token_embd.weight' (dimensions [4611686018427387904, 4]"),
        ("more_pieces_than_rows", "tokenizer.ggml.tokens has 8 entries, more than the 4 rows"),
    ],
)
def test_a_file_whose_counts_exceed_it_is_refused_at_once(tmp_path, case, words):
    path = _hostile(tmp_path, case)
    tracemalloc.start()
    t0 = time.monotonic()
    for read in (load_model_config, lambda p: load_gguf_tokenizer(GGUFFile(p))):
        with pytest.raises(ValueError, match="is not a readable GGUF file") as e:
            read(path)
        assert words in str(e.value), str(e.value)
    _, peak_bytes = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert time.monotonic() - t0 < 2.0
    assert peak_bytes < 4 * 2**20


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"uint32": {"llama.block_count": 10_000_000}},
         "llama.block_count is 10000000, but the file has no tensors for layer 1"),
        ({"uint32": {"llama.attention.head_count": 0}},
         "llama.attention.head_count must be at least 1 (got 0)"),
        ({"uint32": {"llama.attention.head_count": 64}},
         "llama.attention.head_count is 64, more than llama.embedding_length (32)"),
        ({"q_rows": 64}, "llama.attention.head_count x the head dimension (2 x 16) is 32, but "
                         "blk.0.attn_q.weight has 64 rows"),
        ({"uint32": {"llama.embedding_length": 2**40}},
         "llama.embedding_length is 1099511627776, but token_embd.weight has 32 columns"),
        ({"uint32": {"llama.feed_forward_length": 10**9}},
         "llama.feed_forward_length is 1000000000, but blk.0.ffn_up.weight has 64 rows"),
        ({"uint32": {"llama.context_length": 2**40}},
         "llama.context_length is 1099511627776, more than 16777216 (the most pagedd serves)"),
        ({"uint32": {"llama.vocab_size": 3_000_000}},
         "llama.vocab_size is 3000000, more than 4 (the rows of token_embd.weight)"),
    ],
)  # fmt: skip
def test_sizes_the_tensors_present_do_not_back_are_refused(tmp_path, kwargs, words):
    path = _write(tmp_path / "m.gguf", **kwargs)
    t0 = time.monotonic()
    with pytest.raises(ValueError) as e:
        load_model_config(path)
    assert words in str(e.value)
    assert time.monotonic() - t0 < 2.0


def test_the_daemon_refuses_it_in_one_line(tmp_path):
    """`pagedd serve` on such a file: one ERROR line naming the field, no traceback."""
    path = _write(tmp_path / "m.gguf", uint32={"llama.attention.head_count": 0})
    run = subprocess.run(
        [sys.executable, "-m", "pydaemon", "serve", "--model", str(path), "--device", "cpu",
         "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode != 0
    assert "llama.attention.head_count must be at least 1" in run.stderr
    assert "Traceback" not in run.stderr, run.stderr
