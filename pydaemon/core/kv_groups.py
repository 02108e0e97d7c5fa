"""Per-layer-group KV tables: models that mix windowed and full-attention layers.

Gemma 2 and 3 and gpt-oss interleave sliding-window layers with global ones. With one block
table per sequence every layer keeps every block, so a windowed layer holds the KV memory of
a global one. As vLLM's hybrid allocator does, the layers are split into **groups** of
``num_slots`` layers of one kind (the same window); a KV block holds one block of tokens for
``num_slots`` layers (one *slot* per layer of a group), and each sequence has one table per
group, all drawn from the one pool. A windowed group's table releases the blocks that leave
its window as the sequence advances (``SeqBlocks.release_outside_window``); a global group's
keeps them all. Gemma 3 (five local layers to one global): ``num_slots`` = its global layer
count, one global group and about five local ones, so a long sequence holds about
global / all of the blocks it held before.

The group size is the smallest kind's layer count; a kind whose count is not a multiple of it
gets a last group with fewer layers (its spare slots are left unused). Groups are ordered
global first, so that group 0 is a table that keeps every block.

Off (one table, every layer keeps every block) where every layer has the same window (the
all-windowed case frees blocks through ``kv_window`` instead), with pipeline stages, with a
draft model or an EAGLE head (their caches read the target's table), and with the CPU tier
(its loads and saves are per table).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pydaemon.config.model import ModelConfig
from pydaemon.config.runner import RunnerConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]  # per group: its layers' window (None: full attention)
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its slot in a block of its group
    num_slots: int  # layers a block holds (the largest group)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def salts(self, cache_salt: str) -> list[str]:
        """One prefix-cache salt per group: no group is ever served another group's blocks
        (they hold other layers' K/V for the same tokens)."""
        return [
            cache_salt if g == 0 else f"{cache_salt}\x1fkv-group-{g}"
            for g in range(len(self.windows))
        ]


def plan_kv_groups(layer_windows: list[int | None]) -> KVGroups | None:
    """The groups for these per-layer windows, or None when every layer has the same one."""
    kinds = sorted(set(layer_windows), key=lambda w: -1 if w is None else w)
    if len(kinds) < 2:
        return None
    members = {kind: [i for i, w in enumerate(layer_windows) if w == kind] for kind in kinds}
    size = min(len(layers) for layers in members.values())
    windows: list[int | None] = []
    layer_group = [0] * len(layer_windows)
    layer_slot = [0] * len(layer_windows)
    for kind in kinds:
        layers = members[kind]
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start : start + size]):
                layer_group[layer] = len(windows)
                layer_slot[layer] = slot
            windows.append(kind)
    return KVGroups(tuple(windows), tuple(layer_group), tuple(layer_slot), size)


def kv_groups(model_config: ModelConfig, config: RunnerConfig) -> KVGroups | None:
    """The model's KV groups under this runner configuration (module docstring: when off)."""
    groups = plan_kv_groups(list(model_config.layer_sliding_windows or []))
    if groups is None:
        return None
    why = None
    if config.pipeline_parallel_size > 1:
        why = "pipeline stages"
    elif config.speculative is not None and config.speculative.method != "ngram":
        why = f"a {config.speculative.method} proposer's KV cache"
    elif config.kv_tiers.has_cpu_tier:
        why = "the CPU tier (--kv-offloading-size)"
    if why is not None:
        logger.warning(
            "windowed and full-attention layers: every layer keeps every block (per-layer-group "
            "tables are off with %s)",
            why,
        )
        return None
    return groups
