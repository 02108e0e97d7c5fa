"""Engine statistics: what operators, metrics and benchmarks read of the engine core."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydaemon.core.iteration_tokens import IterationTokens


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    num_gpu_blocks: int
    num_free_gpu_blocks: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    kv_waste_slots: int
    num_shared_blocks: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    num_swapped_out_blocks: int
    num_swapped_in_blocks: int
    num_prompt_tokens: int
    num_generation_tokens: int
    spec_decode: SpecDecodeStats | None = None  # None: speculative decoding is off
    # LoRA: adapter name -> (running, waiting) requests, for adapters with live requests
    lora_requests: dict[str, tuple[int, int]] = field(default_factory=dict)
    max_loras: int = 0  # 0: LoRA is off
    kv_tiers: KVTierStats | None = None  # None: no CPU tier (--kv-offloading-size)
    # Of num_waiting, those held back by something else than room to run them (a grammar
    # still compiling): vLLM's reason "deferred"; the others' is "capacity".
    num_waiting_deferred: int = 0
    iteration_tokens: IterationTokens = field(default_factory=IterationTokens)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hit_tokens / max(1, self.prefix_cache_query_tokens)


@dataclass
class KVCacheStats:
    """The block manager's counters, as plain data."""

    num_gpu_blocks: int
    num_free_gpu_blocks: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    kv_waste_slots: int
    num_shared_blocks: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    kv_tiers: KVTierStats | None = None


@dataclass
class KVTierStats:
    """The KV tiers since start: prefix-cache hits by the tier that served them (tokens; a
    miss is a queried token no tier held: ``prefix_cache_query_tokens`` minus every hit),
    copies each way (bytes, summed over tensor-parallel ranks) and what each tier holds now
    (blocks). The CPU pool is shared with swap: ``num_cpu_cached_blocks`` of its blocks hold
    the CPU tier's entries (free for swap to take), the rest is free or swapped out."""

    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    gpu_to_cpu_bytes: int = 0
    cpu_to_gpu_bytes: int = 0
    cpu_to_disk_bytes: int = 0
    disk_to_cpu_bytes: int = 0
    num_cpu_cached_blocks: int = 0
    num_disk_blocks: int = 0  # 0: no disk tier
    num_disk_cached_blocks: int = 0
    num_dropped_loads: int = 0  # loads cancelled because their sequence was freed first
    num_restored_disk_blocks: int = 0  # found on disk at start (warm restart)
    # Disk reads that did not deliver what was written (not served: recomputed), writes that
    # did not land (a full or failing disk), and whether the tier stopped taking writes.
    num_failed_disk_reads: int = 0
    num_failed_disk_writes: int = 0
    are_disk_writes_stopped: bool = False

    @property
    def external_hit_tokens(self) -> int:
        """Hits served from below the GPU (vLLM's external prefix-cache hits)."""
        return self.cpu_hit_tokens + self.disk_hit_tokens


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0


@dataclass
class SpecDecodeStats:
    """Speculative decoding's counters since start (vLLM's): verify steps of a sequence that
    had drafts, drafts proposed, drafts accepted, and accepted drafts by position (index j:
    the (j+1)-th draft of a step). ``drafts_off_at``: the lowest batch size of each batch-size
    bucket where the governor has turned drafts off (measured slower there; filled in by the
    engine core's stats, pydaemon/core/sched/spec_governor.py)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafts_off_at: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        per_position = self.accepted_per_position
        if len(per_position) < num_drafts:
            per_position.extend([0] * (num_drafts - len(per_position)))
        for j in range(num_accepted):
            per_position[j] += 1

    def snapshot(self, drafts_off_at: list[int] | None = None) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.accepted_per_position),
            list(drafts_off_at or []),
        )

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(1, self.num_draft_tokens)
