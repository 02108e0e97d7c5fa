"""Engine statistics: what operators, metrics and benchmarks read of the engine core."""

from __future__ import annotations

from dataclasses import dataclass, field


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
