"""The peer-comparison benchmark runs end to end on a tiny size (no timing is asserted)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT.parent / "shared" / "bench" / "peers"


@pytest.mark.skipif(not (PEERS / "workload.py").is_file(), reason="needs ../shared/bench/peers")
def test_bench_manager_runs_the_peer_workloads_and_hits_like_vllm():
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "bench_manager.py"),
        *("--runs", "1", "--num-requests", "24", "--churn-iters", "5", "--workloads", "a,b,c"),
        *("--churn-sizes", "10,100", "--layouts", "full,hybrid,tiers,lru"),
    ]
    env = dict(os.environ, KVPOOL_DEBUG="1")  # the benchmark turns the checker off itself
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    report = json.loads(done.stdout)["medians"]
    assert set(report["a"]) == {"10", "100"}
    assert all(result["cycle_us"] > 0 for result in report["a"].values())
    sys.path.insert(0, str(PEERS))
    try:
        import workload
    finally:
        sys.path.remove(str(PEERS))
    requests = workload.make_prefix_workload(num_requests=24)
    for key in ("b", "b_hybrid", "b_tiers", "b_lru", "c"):
        result = report[key]
        assert result["request_steps"] == 24 * requests.params["decode_len"]
        # vLLM's hits on this workload: full blocks of every prefix seen before, never the last
        # prompt token (a pool of 32,768 blocks evicts nothing for 24 requests).
        assert result["prefix_hit_tokens"] == requests.ideal_hit_tokens() > 0
    assert report["b_tiers"]["slots_per_level"] == [[32768], [32768], [65536]]
    assert report["c"]["slots_per_level"] == [[32768, 32768]]  # (window group, full group)


@pytest.mark.skipif(not (PEERS / "workload.py").is_file(), reason="needs ../shared/bench/peers")
@pytest.mark.parametrize(
    ("script", "extra", "key"),
    [("bench_policy.py", ["--policies", "hazard,lfu"], "hazard"), ("bench_events.py", [], "on_us")],
)
def test_the_variant_benchmarks_run_each_variant_on_workload_b(script, extra, key):
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / script),
        *("--runs", "1", "--num-requests", "24", "--layouts", "full", *extra),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    full = json.loads(done.stdout)["full"]
    assert key in full and "(b) full" in done.stderr
    if script == "bench_policy.py":  # the same hits under every policy (nothing is evicted)
        assert {figures["prefix_hit_tokens"] for figures in full.values()} == {
            full["lru"]["prefix_hit_tokens"]
        }
        assert full["lru"]["ratio"] == 1.0


def test_the_transformers_benchmark_runs_and_reuses_and_shares():
    pytest.importorskip("transformers")
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "bench_transformers.py"),
        *("--quick", "--runs", "1", "--contexts", "32"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    report = json.loads(done.stdout[done.stdout.index("{") :])["llama-small"]
    prefill, cow = report["prefill"], report["cow"]
    assert prefill["cached_tokens"] == prefill["turn_tokens"] - 1 > 0
    assert cow["forks"] > 0 and 0 < cow["pages_copied_on_write"] < cow["pages_if_every_fork_copied"]
    assert [row["context"] for row in report["decode"]] == [32]
