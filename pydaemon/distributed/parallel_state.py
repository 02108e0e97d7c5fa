"""The process groups of this rank, and the collectives the model and the runner use.

Ranks are laid out as vLLM lays them: ``rank = pp_rank * tp_size + tp_rank``. The ranks of one
pipeline stage form a tensor-parallel group (activations all-reduced inside the forward
pass); the ranks of one ``tp_rank`` across the stages form a pipeline group (a stage sends
its intermediate tensors to the next one, point to point). Expert parallelism, when on,
partitions the experts over the tensor-parallel group (pydaemon/layers/moe/layer.py): its
group is the TP group.

Without ``init_model_parallel`` (one rank, the default) every helper is a no-op that returns
its input: the single-process path has no process group at all.

Two kinds of group when the backend is NCCL: device groups (NCCL) carry activations; CPU
groups (gloo) carry small host-side agreements (the KV block count). On CPUs both are gloo.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class _ParallelState:
    rank: int  # global
    world_size: int
    tp_size: int
    pp_size: int
    local_rank: int  # the CUDA device index of this rank on its host
    backend: str
    is_expert_parallel: bool
    tp_device_group: dist.ProcessGroup
    tp_cpu_group: dist.ProcessGroup
    pp_device_group: dist.ProcessGroup
    world_cpu_group: dist.ProcessGroup

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_first_rank(self) -> int:
        """The global rank of tp_rank 0 of this stage (gathers and broadcasts go there)."""
        return self.pp_rank * self.tp_size


_STATE: _ParallelState | None = None


def init_model_parallel(
    rank: int,
    world_size: int,
    backend: str,
    init_method: str,
    timeout_s: float,
    *,
    tensor_parallel_size: int,
    pipeline_parallel_size: int = 1,
    local_rank: int | None = None,
    enable_expert_parallel: bool = False,
) -> None:
    """Joins the world of ``world_size`` ranks (blocks until all have joined) and builds the
    tensor- and pipeline-parallel groups (every rank builds every group, in the same order)."""
    global _STATE
    if _STATE is not None:
        raise RuntimeError(
            "this process already runs a model-parallel engine (one per process): "
            "call engine.shutdown() on it first"
        )
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"distributed backend must be 'nccl' or 'gloo', got {backend!r}")
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if tp * pp != world_size:
        raise ValueError(
            f"world size {world_size} != tensor_parallel_size {tp} x pipeline_parallel_size {pp}"
        )
    local_rank = rank if local_rank is None else local_rank
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)  # before the communicator is created
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
    )
    world = dist.group.WORLD
    world_cpu = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    tp_device = tp_cpu = pp_device = world
    if pp > 1:
        tp_device, tp_cpu = _my_group(
            [[s * tp + t for t in range(tp)] for s in range(pp)], rank, backend, timeout
        )
    elif backend != "gloo":
        tp_cpu = world_cpu
    if tp > 1 and pp > 1:
        pp_device, _ = _my_group(
            [[s * tp + t for s in range(pp)] for t in range(tp)], rank, backend, timeout
        )
    _STATE = _ParallelState(
        rank,
        world_size,
        tp,
        pp,
        local_rank,
        backend,
        enable_expert_parallel and tp > 1,
        tp_device,
        tp_cpu,
        pp_device,
        world_cpu,
    )


def _my_group(
    groups: list[list[int]], rank: int, backend: str, timeout: datetime.timedelta
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Creates every group of the list (collectively: each rank creates all of them) and
    -> (device group, CPU group) of the one holding ``rank``."""
    mine = None
    for ranks in groups:
        device = dist.new_group(ranks, backend=backend, timeout=timeout)
        cpu = (
            device if backend == "gloo" else dist.new_group(ranks, backend="gloo", timeout=timeout)
        )
        if rank in ranks:
            mine = (device, cpu)
    assert mine is not None
    return mine


def destroy_model_parallel() -> None:
    global _STATE
    if _STATE is None:
        return
    _STATE = None
    if dist.is_initialized():
        dist.destroy_process_group()


def abort_model_parallel() -> None:
    """Makes a collective blocked on a dead peer return (NCCL); gloo notices dead peers itself."""
    if _STATE is None or _STATE.backend != "nccl":
        return
    groups = {id(g): g for g in (_STATE.tp_device_group, _STATE.pp_device_group)}
    for group in groups.values():
        try:  # private API, guarded: the fallback is the process group's own timeout
            group._get_backend(torch.device("cuda")).abort()
        except Exception:  # noqa: BLE001
            pass


@contextlib.contextmanager
def unsharded() -> Iterator[None]:
    """Within: this process looks like a single rank (builds the whole model, as one process
    would: the names and order of its checkpoint tensors, for dummy weights)."""
    global _STATE
    saved, _STATE = _STATE, None
    try:
        yield
    finally:
        _STATE = saved


# ---- who this rank is ---------------------------------------------------------------------
def is_tensor_parallel() -> bool:
    return _STATE is not None and _STATE.tp_size > 1


def get_world_size() -> int:
    return 1 if _STATE is None else _STATE.world_size


def get_rank() -> int:
    return 0 if _STATE is None else _STATE.rank


def get_local_rank() -> int:
    return 0 if _STATE is None else _STATE.local_rank


def get_tp_rank() -> int:
    return 0 if _STATE is None else _STATE.tp_rank


def get_tp_world_size() -> int:
    return 1 if _STATE is None else _STATE.tp_size


def get_pp_rank() -> int:
    return 0 if _STATE is None else _STATE.pp_rank


def get_pp_world_size() -> int:
    return 1 if _STATE is None else _STATE.pp_size


def is_first_pp_rank() -> bool:
    return get_pp_rank() == 0


def is_last_pp_rank() -> bool:
    return get_pp_rank() == get_pp_world_size() - 1


def is_sampling_rank() -> bool:
    """The rank that samples: tp_rank 0 of the last pipeline stage."""
    return is_last_pp_rank() and get_tp_rank() == 0


def get_ep_world_size() -> int:
    """Ranks the experts are partitioned over (the TP group, when expert parallel is on)."""
    return _STATE.tp_size if _STATE is not None and _STATE.is_expert_parallel else 1


def get_ep_rank() -> int:
    return get_tp_rank() if get_ep_world_size() > 1 else 0


# ---- tensor-parallel collectives (within a stage) -----------------------------------------
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the TP group, in place; the identity at TP=1."""
    if _STATE is None or _STATE.tp_size == 1:
        return x
    dist.all_reduce(x, group=_STATE.tp_device_group)
    return x


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """Elementwise max over the TP group, in place; the identity at TP=1."""
    if _STATE is None or _STATE.tp_size == 1:
        return x
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=_STATE.tp_device_group)
    return x


def gather_last_dim(x: torch.Tensor) -> torch.Tensor | None:
    """x: [N, D] on every TP rank -> [N, tp_size * D] on tp_rank 0 (rank order), None on
    the others."""
    if _STATE is None or _STATE.tp_size == 1:
        return x
    x = x.contiguous()
    dst = _STATE.tp_first_rank
    if _STATE.tp_rank == 0:
        parts = [torch.empty_like(x) for _ in range(_STATE.tp_size)]
        dist.gather(x, parts, dst=dst, group=_STATE.tp_device_group)
        return torch.cat(parts, dim=-1)
    dist.gather(x, None, dst=dst, group=_STATE.tp_device_group)
    return None


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """x: tp_rank 0's tensor, or a buffer of its shape and dtype elsewhere; every TP rank
    ends with tp_rank 0's values (in place). In stream order on NCCL: no host sync."""
    if _STATE is None or _STATE.tp_size == 1:
        return x
    dist.broadcast(x, src=_STATE.tp_first_rank, group=_STATE.tp_device_group)
    return x


def min_across_ranks(value: int) -> int:
    """The smallest ``value`` of all ranks, every stage included (e.g. KV blocks: one block
    manager drives every rank, so each must hold as many)."""
    if _STATE is None or _STATE.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_STATE.world_cpu_group)
    return int(t.item())


def min_max_across_ranks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: a CPU int64 tensor of the same shape on every rank -> (elementwise min, max) over
    every rank, every stage included (host-side agreements, on the CPU group); (x, x) alone."""
    if _STATE is None or _STATE.world_size == 1:
        return x, x
    low, high = x.clone(), x.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=_STATE.world_cpu_group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=_STATE.world_cpu_group)
    return low, high


# ---- pipeline point to point (between stages, same tp_rank) -------------------------------
def send_to_next_stage(x: torch.Tensor) -> None:
    """x: the intermediate tensors of this stage, to the same tp_rank of the next stage."""
    assert _STATE is not None and not is_last_pp_rank()
    dist.send(x.contiguous(), dst=_STATE.rank + _STATE.tp_size, group=_STATE.pp_device_group)


def recv_from_prev_stage(x: torch.Tensor) -> torch.Tensor:
    """x: a buffer of the shape and dtype the previous stage sends; filled in place."""
    assert _STATE is not None and not is_first_pp_rank()
    dist.recv(x, src=_STATE.rank - _STATE.tp_size, group=_STATE.pp_device_group)
    return x
