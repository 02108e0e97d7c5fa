"""The identity a rank's disk tier is written under: what must be equal for a block written
by one run to be served by another (a warm restart).

The model by its content: the SHA-256 of every weight file (safetensors headers and data
alike, .bin, .pt, .gguf) and of config.json (dummy weights add the seed that draws them);
the weights' dtype and quantization, the KV cache's dtype and block layout, the layer-group
layout (which layers share a table), the rank's place in the tensor-parallel group, and the
code's KV layout version (``KV_LAYOUT_VERSION``). Two checkpoints with the same names, sizes
and modification times but other weights never share blocks.

Cost: hashing reads every weight file once, at about 0.75 GB/s a file on one core (measured;
up to 4 files of a sharded checkpoint at once), so the first start with a disk tier of a 16 GB
model takes about 6-22 s more (plus reading it, if it is not in the page cache). The hashes
are kept in the tier directory (``weights-sha256.json``), each under its file's device, inode,
size, modification and change times (ns): a later start reads nothing. Any change to a file
(a rewrite in place, even with its old mtime restored: the change time moves) or a copy (a
new inode) is hashed again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pydaemon.config.runner import RunnerConfig
from pydaemon.core.kv_groups import KVGroups
from pydaemon.model_loader.model_paths import resolve_model_dir
from pydaemon.worker.kv_cache import KVCacheSpec
from pydaemon.worker.kv_disk_folder import TierDir

logger = logging.getLogger(__name__)

# The meaning of a block's bytes: [layers, 2 (K, V), kv heads, block size, head dim] in the
# cache's dtype, as worker/kv_cache.py lays it out. Bump on any change to that layout (or to
# how K or V are computed into it): files of the old layout are then never read.
KV_LAYOUT_VERSION = 1
HASH_CACHE_FILE = "weights-sha256.json"
_MAX_HASH_CACHE_ENTRIES = 4096
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_CHUNK = 8 << 20


def kv_disk_identity(
    config: RunnerConfig,
    weight_dtype: str,
    spec: KVCacheSpec,
    tp_rank: int,
    tp_size: int,
    kv_groups: KVGroups | None = None,
    hash_cache: TierDir | None = None,
) -> dict:
    """``hash_cache``: the folder that keeps the weight files' hashes (the tier directory)."""
    identity = {
        "kv_layout_version": KV_LAYOUT_VERSION,
        "model": model_fingerprint(config.model, hash_cache),
        "load_format": config.load_format,
        "weight_dtype": weight_dtype,
        "quantization": config.quantization,
        "kv_cache_dtype": str(spec.dtype).removeprefix("torch."),
        "block_shape": list(spec.block_shape),  # [layers, 2, kv heads, block size, head dim]
        "kv_groups": None
        if kv_groups is None
        else {"layer_group": list(kv_groups.layer_group), "windows": list(kv_groups.windows)},
        "tp_rank": tp_rank,
        "tp_size": tp_size,
    }
    if config.load_format == "dummy":
        identity["seed"] = config.seed  # dummy weights are drawn from it
    return identity


def model_fingerprint(model: str | Path, hash_cache: TierDir | None = None) -> dict:
    """The SHA-256 of a model directory's weight files and config.json (or of a .gguf
    file), by file name."""
    path = resolve_model_dir(str(model))
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    weights = [f for f in files if f.suffix in _WEIGHT_SUFFIXES]
    config = path / "config.json" if path.is_dir() else None
    if config is not None and config.is_file():
        weights.append(config)
    digests = _hash_files(weights, hash_cache)
    return {"sha256": {f.name: d for f, d in zip(weights, digests, strict=True)}}


def _hash_files(files: list[Path], hash_cache: TierDir | None) -> list[str]:
    cache = _read_cache(hash_cache)
    keys = [_file_key(f) for f in files]
    todo = [i for i, k in enumerate(keys) if k not in cache]
    if todo:
        start = time.monotonic()
        size = sum(files[i].stat().st_size for i in todo)
        logger.info(
            "disk tier: hashing %d weight file(s), %.1f GB, for the tier's model identity "
            "(once: kept in %s)",
            len(todo),
            size / 1e9,
            HASH_CACHE_FILE,
        )
        # hashlib releases the GIL on large buffers: shards hash in parallel.
        with ThreadPoolExecutor(max_workers=min(4, len(todo))) as pool:
            digests = list(pool.map(lambda i: _sha256(files[i]), todo))
        for i, digest in zip(todo, digests, strict=True):
            if _file_key(files[i]) == keys[i]:  # unchanged while it was read
                cache[keys[i]] = digest
            else:
                raise RuntimeError(f"{files[i]} changed while it was hashed: start again")
        logger.info("disk tier: hashed in %.1f s", time.monotonic() - start)
        _write_cache(hash_cache, cache)
    return [cache[k] for k in keys]


def _file_key(path: Path) -> str:
    st = path.stat()
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _read_cache(folder: TierDir | None) -> dict[str, str]:
    raw = None if folder is None else folder.read_file(HASH_CACHE_FILE, 4 << 20)
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}


def _write_cache(folder: TierDir | None, cache: dict[str, str]) -> None:
    if folder is None:
        return
    entries = list(cache.items())[-_MAX_HASH_CACHE_ENTRIES:]  # the newest
    try:
        folder.replace_file(HASH_CACHE_FILE, json.dumps(dict(entries), indent=0).encode())
    except OSError as e:  # a cache: the next start hashes again
        logger.warning("disk tier: cannot keep the weights' hashes in %s: %s", folder.path, e)
