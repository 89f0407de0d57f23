"""kvpool's counters inside vLLM's own metrics: `KVPoolConnectorStats` travels from the
connector's two sides to vLLM's stats logger each step (vLLM sums the workers' and the
scheduler's), which logs it ("KV Transfer metrics") and hands it to `KVPoolPromMetrics` for
vLLM's Prometheus endpoint, next to vLLM's own metrics."""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

TIERS = ("host", "disk", "remote")
# (name: what it counts); hit tokens are counted per tier, as `kvpool:hit_tokens{tier=...}`
COUNTERS = {
    "lookups": "prompts looked up in kvpool",
    "loaded_blocks": "vLLM blocks (of every KV-cache group) loaded from kvpool",
    "saved_blocks": "vLLM blocks (of every KV-cache group) saved into kvpool",
    "skipped_saves": "saves skipped: no room at kvpool's first level",
    "skipped_window_saves": "saves skipped: vLLM had freed a sliding-window block they need",
    "failed_saves": "saves a worker could not write (nothing committed)",
    "load_failures": "lookups whose pages could not be brought up (a read error: a miss)",
    "load_errors": "blocks a worker could not load (vLLM recomputes them)",
    "bytes_loaded": "bytes copied from kvpool into vLLM's blocks (all ranks)",
    "bytes_saved": "bytes copied from vLLM's blocks into kvpool (all ranks)",
}
KEYS = (*COUNTERS, *(f"hit_tokens_{tier}" for tier in TIERS))


@dataclasses.dataclass
class KVPoolConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """Counts since the last report: `data` maps each of `KEYS` to an int."""

    def __post_init__(self) -> None:
        for key in KEYS:
            self.data.setdefault(key, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(KEYS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = dict(self.data)
        for key, value in other.data.items():
            merged[key] = merged.get(key, 0) + value
        return KVPoolConnectorStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        return {key: self.data[key] for key in KEYS}

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in KEYS)


class Deltas:
    """What changed in a set of counters since the last `take`."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def take(self, now: dict[str, int]) -> KVPoolConnectorStats | None:
        delta = {key: value - self._last.get(key, 0) for key, value in now.items()}
        self._last = dict(now)
        stats = KVPoolConnectorStats(data=delta)
        return None if stats.is_empty() else stats


class KVPoolPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """`kvpool:<counter>` per engine, and `kvpool:hit_tokens` per engine and tier."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._bound: dict[tuple[int, str], Any] = {}
        for name, documentation in COUNTERS.items():
            counter = self._counter_cls(
                name=f"kvpool:{name}", documentation=documentation, labelnames=labelnames
            )
            for engine, values in per_engine_labelvalues.items():
                self._bound[(engine, name)] = counter.labels(*values)
        hits = self._counter_cls(
            name="kvpool:hit_tokens",
            documentation="prompt tokens kvpool served, by the tier it found them on",
            labelnames=[*labelnames, "tier"],
        )
        for engine, values in per_engine_labelvalues.items():
            for tier in TIERS:
                self._bound[(engine, f"hit_tokens_{tier}")] = hits.labels(*values, tier)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            metric = self._bound.get((engine_idx, key))
            if metric is not None and value:
                metric.inc(value)
