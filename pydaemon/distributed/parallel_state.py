"""The tensor-parallel process group of this process, and the collectives the model uses.

Without ``init_tensor_parallel`` (TP=1, the default) the world size is 1 and every helper is
a no-op that returns its input: the single-process path has no process group at all.

Two groups when the backend is NCCL: the device group (NCCL) carries activations inside the
forward pass; the CPU group (gloo) carries small host-side agreements (the KV block count).
On CPUs both are the same gloo group.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class _TensorParallelGroup:
    rank: int
    world_size: int
    backend: str
    device_group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup


_TP: _TensorParallelGroup | None = None


def init_tensor_parallel(
    rank: int, world_size: int, backend: str, init_method: str, timeout_s: float
) -> None:
    """Joins the group of ``world_size`` ranks (blocks until all have joined)."""
    global _TP
    if _TP is not None:
        raise RuntimeError(
            "this process already runs a tensor-parallel engine (one per process): "
            "call engine.shutdown() on it first"
        )
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"tensor-parallel backend must be 'nccl' or 'gloo', got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        torch.cuda.set_device(rank)  # before the communicator is created
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
    )
    world = dist.group.WORLD
    cpu_group = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    _TP = _TensorParallelGroup(rank, world_size, backend, world, cpu_group)


def destroy_tensor_parallel() -> None:
    global _TP
    if _TP is None:
        return
    _TP = None
    if dist.is_initialized():
        dist.destroy_process_group()


def abort_tensor_parallel() -> None:
    """Makes a collective blocked on a dead peer return (NCCL); gloo notices dead peers itself."""
    if _TP is None or _TP.backend != "nccl":
        return
    try:  # private API, guarded: the fallback is the process group's own timeout
        _TP.device_group._get_backend(torch.device("cuda")).abort()
    except Exception:  # noqa: BLE001
        pass


def is_tensor_parallel() -> bool:
    return _TP is not None and _TP.world_size > 1


def get_tp_rank() -> int:
    return 0 if _TP is None else _TP.rank


def get_tp_world_size() -> int:
    return 1 if _TP is None else _TP.world_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place; the identity at TP=1."""
    if _TP is None or _TP.world_size == 1:
        return x
    dist.all_reduce(x, group=_TP.device_group)
    return x


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """Elementwise max over ranks, in place; the identity at TP=1."""
    if _TP is None or _TP.world_size == 1:
        return x
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=_TP.device_group)
    return x


def gather_last_dim(x: torch.Tensor) -> torch.Tensor | None:
    """x: [N, D] on every rank -> [N, world_size * D] on rank 0 (rank order), None elsewhere."""
    if _TP is None or _TP.world_size == 1:
        return x
    x = x.contiguous()
    if _TP.rank == 0:
        parts = [torch.empty_like(x) for _ in range(_TP.world_size)]
        dist.gather(x, parts, dst=0, group=_TP.device_group)
        return torch.cat(parts, dim=-1)
    dist.gather(x, None, dst=0, group=_TP.device_group)
    return None


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """x: rank 0's tensor, or a buffer of its shape and dtype elsewhere; every rank ends with
    rank 0's values (in place). In stream order on NCCL: no host sync."""
    if _TP is None or _TP.world_size == 1:
        return x
    dist.broadcast(x, src=0, group=_TP.device_group)
    return x


def min_across_ranks(value: int) -> int:
    """The smallest ``value`` of all ranks (e.g. KV blocks: every rank must hold as many)."""
    if _TP is None or _TP.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_TP.cpu_group)
    return int(t.item())


def min_max_across_ranks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: a CPU int64 tensor of the same shape on every rank -> (elementwise min, max) over
    the ranks (host-side agreements, on the CPU group); (x, x) at TP=1."""
    if _TP is None or _TP.world_size == 1:
        return x, x
    low, high = x.clone(), x.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=_TP.cpu_group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=_TP.cpu_group)
    return low, high
