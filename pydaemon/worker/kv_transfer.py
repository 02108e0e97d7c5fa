"""KVTransfer: one rank's block copies of a step, between its GPU cache, its CPU pool and its
disk tier, in the order the scheduler's plan needs and without a host sync.

A step (``move``) on CUDA with our kernels:

1. the compute stream waits for the previous step's background copies (its loads wrote, and
   its ahead saves read, blocks this step may reuse or read);
2. on the copy stream, after the work already queued on the compute stream (the last step's
   forward wrote blocks saved now, and may still read blocks overwritten now): the saves of
   evicted blocks and the swap-outs (GPU -> CPU), then the swap-ins (CPU -> GPU); the compute
   stream waits for them (an event) before this step's K/V writes;
3. copy-on-write copies, on the compute stream;
4. on the copy stream, while the step's forward runs: the loads (CPU -> GPU: their sequences
   run from the next step on) and the ahead saves (GPU -> CPU); an event marks their end for
   the next step's step 1;
5. the disk reads, then the disk writes (of blocks saved in this step or before) go to the
   disk tier's I/O thread, which first waits (on its own thread) for an event after all of
   the above; once the step is sampled, ``disk_report`` waits for its reads (they had the
   forward pass) and tells the scheduler which did not deliver their block.

Before 2 and 4 the step thread waits for any disk batch still reading or writing the CPU blocks
those copies touch: it had a whole step to finish, so the wait is normally over at once.
Without our kernels (on a CPU, or an extension without CUDA) every copy runs at once, in the
same order; blocks are copied as bytes either way (an FP8 cache stays FP8).
"""

from __future__ import annotations

import math
from concurrent.futures import Future

import torch

from pydaemon.core.disk_blocks import DiskTierReport
from pydaemon.core.sched.scheduler_output import SchedulerOutput
from pydaemon.distributed import parallel_state as ps
from pydaemon.worker.kv_disk_tier import DiskTier

Pairs = list[tuple[int, int]]


class KVTransfer:
    """kv_cache: [num_gpu_blocks, num_layers, 2, num_kv_heads, block_size, head_dim] (the
    device's); cpu_kv_cache: [num_cpu_blocks, ...] on the CPU (pinned when ``use_kernels``),
    the swap space and the CPU tier; ``disk``: the rank's disk tier, or None."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        cpu_kv_cache: torch.Tensor,
        disk: DiskTier | None,
        use_kernels: bool,
    ) -> None:
        if kv_cache.shape[1:] != cpu_kv_cache.shape[1:] or kv_cache.dtype != cpu_kv_cache.dtype:
            raise ValueError(
                f"KVTransfer: the CPU pool's blocks {tuple(cpu_kv_cache.shape[1:])} "
                f"{cpu_kv_cache.dtype} differ from the KV cache's {tuple(kv_cache.shape[1:])} "
                f"{kv_cache.dtype}"
            )
        self.kv_cache = kv_cache
        self.cpu_kv_cache = cpu_kv_cache
        self.disk = disk
        self._disk_reads: Future | None = None  # this step's disk reads (their failures)
        self._has_reported_stop = False
        self.device = kv_cache.device
        self.is_async = use_kernels and kv_cache.is_cuda
        if self.is_async:
            if len(cpu_kv_cache) and not cpu_kv_cache.is_pinned():
                raise ValueError("KVTransfer: the CPU pool must be pinned to copy asynchronously")
            self.stream = torch.cuda.Stream(self.device)
            self._urgent_done = torch.cuda.Event()
            self._background_done = torch.cuda.Event()
            self._has_background = False
        else:
            # Byte views: indexing works for every dtype (FP8 included) and copies bytes.
            self._gpu_bytes = _bytes_view(kv_cache)
            self._cpu_bytes = _bytes_view(cpu_kv_cache)

    def move(self, out: SchedulerOutput) -> None:
        """Every block copy of the step, issued before its forward pass (see the module
        docstring for the order)."""
        self._disk_reads = None
        self._wait_for_disk(out)
        if self.is_async:
            self._move_async(out)
        else:
            self._move_now(out)

    def disk_report(self, out: SchedulerOutput) -> DiskTierReport | None:
        """After the step ``out`` was launched, on every rank: what its disk reads and the
        writes finished since the last step told, for the scheduler (None: nothing). Waits for
        the step's reads (they had the forward pass to finish). The ranks agree on the reads
        that failed (a read counts as failed if it failed on any rank: a CPU all-reduce, only
        in steps that read from disk, the same steps on every rank); each rank's failed writes
        are its own, and a rank whose writes fail stops writing by itself (its slots then fail
        their reads, which all ranks agree on)."""
        if self.disk is None:
            return None
        reads, reads_done = out.blocks_to_read_from_disk, self._disk_reads
        self._disk_reads = None
        failed_reads: list[tuple[int, int]] = []
        is_stopped = self.disk.are_writes_stopped
        if reads:
            failed = {slot for slot, _ in reads_done.result()}
            flags = [d in failed for d, _ in reads] + [is_stopped]
            _, agreed = ps.min_max_across_ranks(torch.tensor(flags, dtype=torch.int64))
            *bad, stopped = agreed.tolist()
            records = out.disk_read_records
            failed_reads = [(r.disk_block, r.uid) for r, b in zip(records, bad, strict=True) if b]
            is_stopped = bool(stopped)
        failed_writes = self.disk.take_failed_writes()
        has_stop_news = is_stopped and not self._has_reported_stop
        if not (failed_reads or failed_writes or has_stop_news):
            return None
        self._has_reported_stop = self._has_reported_stop or is_stopped
        return DiskTierReport(failed_reads, failed_writes, is_stopped)

    def synchronize(self) -> None:
        """Blocks the host until every copy issued so far is done (tests, shutdown)."""
        if self.is_async:
            self.stream.synchronize()
        if self.disk is not None:
            self.disk.drain()

    def close(self) -> None:
        """Finishes the queued copies and closes the disk tier (its file keeps the blocks).
        Idempotent."""
        if self.is_async:
            self.stream.synchronize()
        if self.disk is not None:
            disk, self.disk = self.disk, None
            disk.close()

    # ---- CUDA: two streams and events -------------------------------------------------------
    def _move_async(self, out: SchedulerOutput) -> None:
        from pydaemon import ops

        compute = torch.cuda.current_stream(self.device)
        if self._has_background:
            compute.wait_event(self._background_done)
            self._has_background = False
        to_cpu = out.blocks_to_save_to_cpu + out.blocks_to_swap_out
        has_urgent = bool(to_cpu or out.blocks_to_swap_in)
        has_background = bool(out.blocks_to_load_from_cpu or out.blocks_to_save_ahead_to_cpu)
        has_disk = self.disk is not None and bool(
            out.blocks_to_write_to_disk or out.blocks_to_read_from_disk
        )
        if has_urgent or has_background:
            self.stream.wait_stream(compute)
        handle = self.stream.cuda_stream
        if has_urgent:
            ops.swap_blocks(self.kv_cache, self.cpu_kv_cache, to_cpu, stream=handle)
            ops.swap_blocks(self.cpu_kv_cache, self.kv_cache, out.blocks_to_swap_in, stream=handle)
            self._urgent_done.record(self.stream)
            compute.wait_event(self._urgent_done)  # before this step's K/V writes; no host sync
        if out.blocks_to_copy:
            ops.copy_blocks(self.kv_cache, out.blocks_to_copy)
        if has_background:
            ops.swap_blocks(
                self.cpu_kv_cache, self.kv_cache, out.blocks_to_load_from_cpu, stream=handle
            )
            ops.swap_blocks(
                self.kv_cache, self.cpu_kv_cache, out.blocks_to_save_ahead_to_cpu, stream=handle
            )
            self._background_done.record(self.stream)
            self._has_background = True
        if has_disk:
            after = (
                torch.cuda.Event()
            )  # after every copy issued so far (its own: never re-recorded)
            after.record(self.stream)
            self._disk_reads = self.disk.submit(
                out.blocks_to_write_to_disk,
                out.disk_write_records,
                out.blocks_to_read_from_disk,
                out.disk_read_records,
                after,
            )

    # ---- at once: CPU, or no kernels ---------------------------------------------------------
    def _move_now(self, out: SchedulerOutput) -> None:
        gpu, cpu = self._gpu_bytes, self._cpu_bytes
        _copy(cpu, gpu, out.blocks_to_save_to_cpu + out.blocks_to_swap_out)
        _copy(gpu, cpu, out.blocks_to_swap_in)
        _copy(gpu, gpu, out.blocks_to_copy)
        _copy(gpu, cpu, out.blocks_to_load_from_cpu)
        _copy(cpu, gpu, out.blocks_to_save_ahead_to_cpu)
        if self.disk is not None:
            self._disk_reads = self.disk.submit(
                out.blocks_to_write_to_disk,
                out.disk_write_records,
                out.blocks_to_read_from_disk,
                out.disk_read_records,
                None,
            )

    def _wait_for_disk(self, out: SchedulerOutput) -> None:
        """The CPU blocks this step's copies read or write are clear of disk batches."""
        if self.disk is None:
            return
        touched = [c for _, c in out.blocks_to_save_to_cpu]
        touched += [c for _, c in out.blocks_to_save_ahead_to_cpu]
        touched += [c for _, c in out.blocks_to_swap_out]
        touched += [c for c, _ in out.blocks_to_swap_in]
        touched += [c for c, _ in out.blocks_to_load_from_cpu]
        if touched:
            self.disk.wait_for(touched)


def _bytes_view(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_bytes] uint8 over the same memory."""
    block_bytes = math.prod(cache.shape[1:]) * cache.element_size()
    return cache.view(torch.uint8).reshape(cache.shape[0], block_bytes)


def _copy(dst: torch.Tensor, src: torch.Tensor, pairs: Pairs) -> None:
    """dst[d] = src[s] for every (s, d); the pairs of one call never overlap."""
    if not pairs:
        return
    both = torch.tensor(pairs, dtype=torch.long)
    src_index, dst_index = both[:, 0].to(src.device), both[:, 1].to(dst.device)
    dst[dst_index] = src[src_index].to(dst.device)
