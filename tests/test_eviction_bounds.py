"""The offline bounds of `benchmarks/eviction_bounds.py` (issue 48): the simulator's LRU is the
reference simulator's, and the oracles keep exactly the blocks they are told will come back."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from eviction_bounds import (  # noqa: E402
    NEVER,
    bound_hit_rate,
    next_uses,
    reuse_oracle,
    window_oracle,
)
from eviction_study import TRACES, load  # noqa: E402

# Requests (seconds, tokens, block ids): two single-use ones between a prefix and its return.
TRACE = [
    (0.0, 1024, [1, 2]),
    (1.0, 1024, [3, 4]),
    (2.0, 1024, [5, 6]),
    (3.0, 1024, [1, 2]),
]


def test_next_uses_name_each_blocks_next_request():
    assert next_uses(TRACE) == [
        {1: 3, 2: 3},
        {3: NEVER, 4: NEVER},
        {5: NEVER, 6: NEVER},
        {1: NEVER, 2: NEVER},
    ]


def test_lru_drops_the_prefix_that_returns_and_the_reuse_oracle_keeps_it():
    # Four blocks: the third request evicts the oldest leaves under LRU (2, then 1), so the
    # last request hits nothing; the oracle evicts the never-reused 4 and 3 instead and the
    # last request hits both blocks: 1,024 of the measured 2,048 tokens.
    assert bound_hit_rate(TRACE, 4) == 0.0
    assert bound_hit_rate(TRACE, 4, reuse_oracle) == 0.5
    # Within a window of 3 requests the prefix is protected, within 2 it is not (LRU).
    assert bound_hit_rate(TRACE, 4, window_oracle(3)) == 0.5
    assert bound_hit_rate(TRACE, 4, window_oracle(2)) == 0.0
    # A cache that holds everything hits the same under each.
    assert bound_hit_rate(TRACE, 6) == bound_hit_rate(TRACE, 6, reuse_oracle) == 0.5


REFERENCE = TRACES / "reference_hitrates_kvcache_simulator.json"


@pytest.mark.skipif(not REFERENCE.is_file(), reason="needs ../shared/traces")
def test_the_simulators_lru_is_the_reference_simulators():
    name = "mooncake_synthetic_trace.jsonl"
    points = json.loads(REFERENCE.read_text())["traces"][name]["points"]
    expected = next(
        p["hit_rate"] for p in points if p["policy"] == "lru" and p["capacity_blocks"] == 1000
    )
    assert bound_hit_rate(load(name), 1000) == pytest.approx(expected, abs=5e-6)
