"""kvpool's counters in vLLM's metrics: the stats object vLLM sums across workers and the
scheduler, and the Prometheus counters it feeds."""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("vllm", reason="needs vLLM (scripts/test.sh runs this in its vLLM venv)")
prometheus_client = pytest.importorskip("prometheus_client")

from kvpool.integrations.vllm.metrics import (  # noqa: E402
    KEYS,
    Deltas,
    KVPoolConnectorStats,
    KVPoolPromMetrics,
)


def test_stats_sum_across_sides_and_report_every_key():
    worker = KVPoolConnectorStats(data={"bytes_loaded": 100, "load_errors": 2})
    scheduler = KVPoolConnectorStats(data={"hit_tokens_disk": 64, "saved_blocks": 3})
    total = worker.aggregate(worker).aggregate(scheduler)
    reduced = total.reduce()
    assert set(reduced) == set(KEYS)
    assert reduced["bytes_loaded"] == 200 and reduced["load_errors"] == 4
    assert reduced["hit_tokens_disk"] == 64 and reduced["saved_blocks"] == 3
    assert not total.is_empty() and KVPoolConnectorStats().is_empty()
    total.reset()
    assert total.is_empty()


def test_deltas_report_only_what_changed():
    deltas = Deltas()
    assert deltas.take({"lookups": 0}) is None
    first = deltas.take({"lookups": 3, "saved_blocks": 1})
    assert first is not None and first.data["lookups"] == 3
    assert deltas.take({"lookups": 3, "saved_blocks": 1}) is None
    second = deltas.take({"lookups": 5, "saved_blocks": 1})
    assert second is not None and second.data["lookups"] == 2 and second.data["saved_blocks"] == 0


def test_prometheus_counters_per_engine_and_tier():
    registry = prometheus_client.CollectorRegistry()
    types = {
        prometheus_client.Gauge: functools.partial(prometheus_client.Gauge, registry=registry),
        prometheus_client.Counter: functools.partial(prometheus_client.Counter, registry=registry),
        prometheus_client.Histogram: functools.partial(
            prometheus_client.Histogram, registry=registry
        ),
    }

    class Config:
        kv_transfer_config = None

    metrics = KVPoolPromMetrics(Config(), types, ["engine"], {0: ["0"], 1: ["1"]})
    metrics.observe({"bytes_saved": 4096, "hit_tokens_remote": 32, "lookups": 0}, engine_idx=1)
    metrics.observe({"bytes_saved": 1024}, engine_idx=1)
    value = registry.get_sample_value
    assert value("kvpool:bytes_saved_total", {"engine": "1"}) == 5120
    assert value("kvpool:bytes_saved_total", {"engine": "0"}) == 0
    assert value("kvpool:hit_tokens_total", {"engine": "1", "tier": "remote"}) == 32
    assert value("kvpool:hit_tokens_total", {"engine": "1", "tier": "host"}) == 0
