"""benchmarks/bench_sglang.py runs (a short trace, one alternating round) and prints its
table: both backends served the same prompts, and what they returned is counted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="needs SGLang (scripts/test.sh runs this in its venv)")

ROOT = Path(__file__).resolve().parents[2]
TRACE = Path("/work/shared/traces/mooncake_conversation_trace.jsonl")


def run(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_sglang.py", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


@pytest.mark.skipif(not TRACE.exists(), reason="the Mooncake trace is not on this machine")
def test_the_trace_benchmark_prints_both_backends():
    out = run("--requests", "40", "--budget-pages", "300")
    rows = [line for line in out.splitlines() if line.startswith(("| file", "| kvpool"))]
    assert len(rows) == 2
    hits = [int(row.split("|")[2].replace(",", "")) for row in rows]
    assert all(h > 0 for h in hits)  # (the trace's shared prefixes came back from L3)


def test_a_budget_below_kvpools_smallest_levels_is_named():
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_sglang.py", "--budget-pages", "10"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2 and "--budget-pages=10 is too small" in done.stderr


def test_the_alternating_rounds_print_both_backends():
    out = run("--rounds", "1", "--round-pages", "256")
    assert "| 0 | file |" in out and "| 0 | kvpool |" in out
