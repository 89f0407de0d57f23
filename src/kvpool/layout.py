"""From layers to pool groups: life cycles, slot layouts and page-index conversion.

A *life cycle* (= layer group) says when a layer's blocks stop being needed. All same-size buffers
of one life cycle's layers are laid side by side in one slot: one *pool* per distinct buffer size,
pools sorted by slot size, largest first. Life cycles whose slot-size lists are identical share a
*pool group*: one slot id addresses the same position in every pool of the group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvpool.config import BatchDesc, LayerConfig
from kvpool.lifecycles import AttentionLifeCycle, LifeCycle, SsmLifeCycle
from kvpool.validation import fail

BAD_PAGE_INDEX = -1


def life_cycle_of(layer: LayerConfig, tokens_per_block: int) -> LifeCycle:
    return layer.life_cycle(tokens_per_block)


@dataclass(frozen=True)
class BufferPlacement:
    """Where one (layer, role) buffer lives: its pool, and its place among the pool slot's buffers.

    Viewing a pool as rows of `size` bytes, the buffer's page of slot `s` is row
    `s * buffers_per_slot + position`, so kernels can address one layer's K or V directly.
    """

    layer_id: int
    role: str
    layer_group: int
    pool_group: int
    pool: int
    size: int
    position: int
    buffers_per_slot: int

    @property
    def offset(self) -> int:
        """Byte offset of this buffer inside its pool's slot."""
        return self.position * self.size

    def page_indices(self, slot_ids: npt.NDArray[np.int32]) -> npt.NDArray[np.int32]:
        """Rows of this buffer's page view for the given slot ids; -1 (no page) stays -1."""
        rows = slot_ids * np.int32(self.buffers_per_slot) + np.int32(self.position)
        return np.where(slot_ids >= 0, rows, np.int32(BAD_PAGE_INDEX)).astype(np.int32, copy=False)


@dataclass(frozen=True)
class PoolGroupLayout:
    """Pools of one slot layout, and the layer groups (life cycles) stored in them."""

    slot_sizes: tuple[int, ...]
    layer_groups: tuple[int, ...]

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot id occupies across all pools of the group."""
        return sum(self.slot_sizes)


class KVLayout:
    """The memory layout of a model: life cycles, pool groups and buffer placements."""

    def __init__(self, layers: Sequence[LayerConfig], tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block
        self.life_cycles: list[LifeCycle] = []
        self.layer_group_of: dict[int, int] = {}
        layers_of_group: list[list[LayerConfig]] = []
        for layer in layers:
            life_cycle = life_cycle_of(layer, tokens_per_block)
            if life_cycle not in self.life_cycles:
                self.life_cycles.append(life_cycle)
                layers_of_group.append([])
            group = self.life_cycles.index(life_cycle)
            self.layer_group_of[layer.layer_id] = group
            layers_of_group[group].append(layer)

        # Per layer group: its pools as (buffer size, [(layer_id, role), ...]), largest slot first.
        pools_of_group = [_coalesce(group_layers) for group_layers in layers_of_group]
        slot_layouts = [
            tuple(size * len(members) for size, members in pools) for pools in pools_of_group
        ]
        distinct = list(dict.fromkeys(slot_layouts))
        self.pool_group_of: list[int] = [distinct.index(slots) for slots in slot_layouts]
        # Layer groups by kind, and attention layer groups per pool group (read per request).
        self.attention: tuple[tuple[int, AttentionLifeCycle], ...] = tuple(
            (g, lc) for g, lc in enumerate(self.life_cycles) if isinstance(lc, AttentionLifeCycle)
        )
        self.attention_pools = tuple((g, self.pool_group_of[g]) for g, _ in self.attention)
        self.windowed = tuple((g, lc) for g, lc in self.attention if lc.window is not None)
        self.ssm_groups = tuple(
            g for g, lc in enumerate(self.life_cycles) if not isinstance(lc, AttentionLifeCycle)
        )
        self.attention_per_pool = [0] * len(distinct)
        for g, _ in self.attention:
            self.attention_per_pool[self.pool_group_of[g]] += 1
        self.pool_groups: list[PoolGroupLayout] = [
            PoolGroupLayout(
                slot_sizes=slots,
                layer_groups=tuple(g for g, pg in enumerate(self.pool_group_of) if pg == index),
            )
            for index, slots in enumerate(distinct)
        ]
        self.buffers: dict[tuple[int, str], BufferPlacement] = {}
        for group, pools in enumerate(pools_of_group):
            for pool, (size, members) in enumerate(pools):
                for position, (layer_id, role) in enumerate(members):
                    self.buffers[layer_id, role] = BufferPlacement(
                        layer_id=layer_id,
                        role=role,
                        layer_group=group,
                        pool_group=self.pool_group_of[group],
                        pool=pool,
                        size=size,
                        position=position,
                        buffers_per_slot=len(members),
                    )

    @property
    def num_layer_groups(self) -> int:
        return len(self.life_cycles)

    def placement(self, layer_id: object, role: object) -> BufferPlacement:
        """Where buffer (`layer_id`, `role`) lives; `ArgumentError` unless it is configured."""
        found = None
        if type(layer_id) is int and type(role) is str:
            found = self.buffers.get((layer_id, role))
        if found is None:
            fail("(layer_id, role)", (layer_id, role), "name a configured buffer")
        return found

    @property
    def num_pool_groups(self) -> int:
        return len(self.pool_groups)

    def pool_group_names(self) -> list[str]:
        """What each pool group holds, e.g. `sliding window 512 + 1 sink blocks`, `full
        attention`, `ssm state` (joined with `, ` where one group holds several life cycles)."""
        return [
            ", ".join(str(self.life_cycles[g]) for g in group.layer_groups)
            for group in self.pool_groups
        ]

    def min_slots(self) -> list[int]:
        """Per pool group, the fewest slots with which one request can always make progress.

        A sliding-window layer group needs its sinks plus its window plus one (the window slides);
        full attention needs as many as the largest window (a request must be able to grow past
        it); SSM needs one state slot.
        """
        largest_window = max(lc.window_floor(self.tokens_per_block) for lc in self.life_cycles)
        floors = [0] * self.num_pool_groups
        for group, life_cycle in enumerate(self.life_cycles):
            if isinstance(life_cycle, AttentionLifeCycle) and life_cycle.window is None:
                floor = largest_window
            else:
                floor = life_cycle.window_floor(self.tokens_per_block)
            floors[self.pool_group_of[group]] += floor
        return floors

    def blocks_needed(self, layer_group: int, capacity: int, history_length: int) -> int:
        """Pages one request of this shape holds in a layer group (at least one)."""
        life_cycle = self.life_cycles[layer_group]
        if isinstance(life_cycle, SsmLifeCycle):
            return 1
        beg, end = life_cycle.stale_range(history_length, self.tokens_per_block)
        return max(-(-capacity // self.tokens_per_block) - (end - beg), 1)

    def request_byte_ratio(self, capacity: int, history_length: int) -> list[float]:
        """Byte share of each pool group for requests of one shape."""
        need = [0] * self.num_pool_groups
        for group in range(self.num_layer_groups):
            pool_group = self.pool_group_of[group]
            blocks = self.blocks_needed(group, capacity, history_length)
            need[pool_group] += blocks * self.pool_groups[pool_group].slot_bytes
        total = sum(need)
        return [n / total for n in need]

    def slots_for_batch(self, batch: BatchDesc) -> list[int]:
        """Slots per pool group that every request of `batch` needs at once.

        Full blocks of the shared system prompt are counted once (minus those stale for every
        request); each request adds its other non-stale blocks. SSM needs one slot per request.
        """
        tpb = self.tokens_per_block
        caches = list(batch.kv_caches)
        need = [0] * self.num_pool_groups
        if not caches:
            return need
        shared = batch.system_prompt_length // tpb
        for group, life_cycle in enumerate(self.life_cycles):
            if isinstance(life_cycle, SsmLifeCycle):
                need[self.pool_group_of[group]] += len(caches)
                continue
            stale = [life_cycle.stale_range(c.history_length, tpb) for c in caches]
            # Shared blocks stale for every request need no slot.
            always_stale = max(0, min(min(e for _, e in stale), shared) - max(b for b, _ in stale))
            slots = shared - always_stale
            for cache, (beg, end) in zip(caches, stale, strict=True):
                live = -(-cache.capacity // tpb) - (end - beg)
                live_shared = shared - max(0, min(end, shared) - beg)
                slots += max(0, live - live_shared)
            need[self.pool_group_of[group]] += slots
        return need

    def pool_group_ratio(self, layer_group_weights: Sequence[float]) -> list[float]:
        """Sum per-layer-group byte weights into per-pool-group weights (normalized)."""
        weights = [0.0] * self.num_pool_groups
        for group, weight in enumerate(layer_group_weights):
            weights[self.pool_group_of[group]] += weight
        total = math.fsum(weights)
        return [w / total for w in weights]


def _coalesce(layers: Sequence[LayerConfig]) -> list[tuple[int, list[tuple[int, str]]]]:
    """Group the buffers of one layer group's layers by size: one pool per size, largest slot
    first (ties: larger buffers first), members in layer then role order."""
    by_size: dict[int, list[tuple[int, str]]] = {}
    for layer in layers:
        for buffer in layer.buffers:
            by_size.setdefault(buffer.size, []).append((layer.layer_id, buffer.role))
    return sorted(by_size.items(), key=lambda item: (-item[0] * len(item[1]), -item[0]))


__all__ = [
    "BAD_PAGE_INDEX",
    "AttentionLifeCycle",
    "BufferPlacement",
    "KVLayout",
    "LifeCycle",
    "PoolGroupLayout",
    "SsmLifeCycle",
    "life_cycle_of",
]
