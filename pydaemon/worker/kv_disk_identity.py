"""The identity a rank's disk tier is written under: what must be equal for a block written
by one run to be served by another (a warm restart).

The model (its config.json's SHA-256 and the names, sizes and modification times of its
weight files: weights rewritten in place change the identity; dummy weights add the seed that
draws them), the weights' dtype and quantization, the KV cache's dtype and block layout, and
the rank's place in the tensor-parallel group. The file format version is the disk tier's.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pydaemon.config.runner import RunnerConfig
from pydaemon.worker.kv_cache import KVCacheSpec

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def model_fingerprint(model: str | Path) -> dict:
    """What identifies a model directory or .gguf file without reading its weights."""
    path = Path(model)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    weights = []
    for f in files:
        if f.suffix in _WEIGHT_SUFFIXES:
            st = f.stat()
            weights.append([f.name, st.st_size, st.st_mtime_ns])
    config = path / "config.json" if path.is_dir() else None
    config_sha = (
        hashlib.sha256(config.read_bytes()).hexdigest() if config and config.is_file() else None
    )
    return {"config_sha256": config_sha, "weights": weights}


def kv_disk_identity(
    config: RunnerConfig,
    weight_dtype: str,
    spec: KVCacheSpec,
    tp_rank: int,
    tp_size: int,
) -> dict:
    identity = {
        "model": model_fingerprint(config.model),
        "load_format": config.load_format,
        "weight_dtype": weight_dtype,
        "quantization": config.quantization,
        "kv_cache_dtype": str(spec.dtype).removeprefix("torch."),
        "block_shape": list(spec.block_shape),  # [layers, 2, kv heads, block size, head dim]
        "tp_rank": tp_rank,
        "tp_size": tp_size,
    }
    if config.load_format == "dummy":
        identity["seed"] = config.seed  # dummy weights are drawn from it
    return identity
