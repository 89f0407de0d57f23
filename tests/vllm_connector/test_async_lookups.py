"""Asynchronous lookups in the connector's scheduler side, against a real valkey-server that
stops answering (SIGSTOP): a lookup that needs the server answers vLLM "not yet" (None) and
never waits for it; a lookup served from host memory answers at once meanwhile; the answer
comes on a later call once the look-ahead threads are done; a request aborted meanwhile
cancels its lookup; a server that fails costs hits, never an answer."""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs vLLM (scripts/test.sh runs this in its vLLM venv)")

from kvpool.integrations.vllm import idle as idle_module
from kvpool.integrations.vllm.idle import IDLE_WAIT_S, IDLE_WAIT_WATCHED_S
from kvpool.integrations.vllm.scheduler import SchedulerSide
from kvpool.integrations.vllm.scoping import reuse_scope
from kvpool.integrations.vllm.settings import (
    ConnectorSettings,
    GroupFormat,
    PageFormat,
)
from tests.valkey_servers import ValkeyServer, server_binary

pytestmark = pytest.mark.skipif(server_binary() is None, reason="no valkey-server binary")
BLOCK = 16
PAGE = PageFormat((GroupFormat(("l0", "l1"), 2, 64, 4, None),), BLOCK, 0, 1)


class Request:
    def __init__(self, request_id: str, tokens: list[int]) -> None:
        self.request_id = request_id
        self.all_token_ids = tokens
        self.cache_salt = None
        self.lora_request = None
        self.mm_features: list[object] = []
        self.prompt_embeds = None
        self.num_computed_tokens = 0
        self.num_prompt_tokens = len(tokens)


@pytest.fixture
def server(tmp_path):
    s = ValkeyServer(tmp_path / "valkey").start()
    yield s
    s.stop()


def scheduler_for(url: str, **extra) -> SchedulerSide:
    settings = ConnectorSettings.parse(
        {"host_bytes": 4 << 20, "remote_url": url, "remote_timeout_ms": 5000, **extra}
    )
    return SchedulerSide(settings, PAGE, "async-test-model")


def commit(side: SchedulerSide, request: Request, blocks: int) -> None:
    """Put `blocks` whole blocks of `request`'s prompt in the side's tree (host level), as a
    finished save would."""
    scope = reuse_scope(request, side.adapters)
    tokens = request.all_token_ids[: blocks * BLOCK]
    cache = side.manager.create_kv_cache(scope, [], remote=False)
    assert cache.resume() and cache.resize(len(tokens))
    cache.commit(tokens)
    side.manager.write_remote(cache)
    cache.close()


def prompt(n: int, blocks: int) -> list[int]:
    return [n * 1000 + i for i in range(blocks * BLOCK + 1)]


def written_by_another_engine(url: str) -> Request:
    """A 4-block request whose prefix another engine wrote to the server (only it holds it)."""
    writer = scheduler_for(url)
    remote = Request("r-remote", prompt(1, 4))
    commit(writer, remote, 4)
    assert writer.manager.flush_remote_writes(10)
    writer.shutdown()
    return remote


def test_a_lookup_waiting_on_the_server_never_holds_the_others(server):
    remote = written_by_another_engine(server.url)

    side = scheduler_for(server.url)
    local = Request("r-local", prompt(2, 3))
    commit(side, local, 3)  # in this engine's host memory: no I/O to answer it
    server.pause()
    try:
        assert side.get_num_new_matched_tokens(remote, 0) == (None, False)  # not yet
        assert side.get_num_new_matched_tokens(remote, 0) == (None, False)  # still not
        assert side.get_num_new_matched_tokens(local, 0) == (3 * BLOCK, True)  # at once
        aborted = Request("r-aborted", prompt(3, 2))
        assert side.get_num_new_matched_tokens(aborted, 0) == (None, False)
        assert side.request_finished(aborted, ([],)) == (False, None)  # cancels its lookup
        assert "r-aborted" not in side.lookups
    finally:
        server.unpause()
    lookahead = side.lookups._waiting["r-remote"]
    assert lookahead.wait(10)
    assert side.get_num_new_matched_tokens(remote, 0) == (4 * BLOCK, True)
    assert side.counters.hit_tokens_by_tier["remote"] == 4 * BLOCK
    assert side.counters.lookups == 3 and side.lookups.started == 2
    side.loads.pop("r-local").cache.close()
    side.loads.pop("r-remote").cache.close()
    assert side.manager.num_open_kv_caches == 0  # (the cancelled lookup held nothing)
    side.shutdown()


def test_an_empty_step_pauses_for_a_waiting_lookup_instead_of_spinning(server):
    """vLLM steps again at once while a request waits: an empty step with a lookup waiting
    pauses (up to IDLE_WAIT_S, less once the lookup is ready); a step with work never does."""
    remote = written_by_another_engine(server.url)

    side = scheduler_for(server.url)
    empty = SimpleNamespace(total_num_scheduled_tokens=0, num_scheduled_tokens={})
    busy = SimpleNamespace(total_num_scheduled_tokens=7, num_scheduled_tokens={"x": 7})
    started = time.perf_counter()
    side.build_connector_meta(empty)  # (nothing waits: no pause)
    assert side.counters.idle_waits == 0
    server.pause()
    try:
        assert side.get_num_new_matched_tokens(remote, 0) == (None, False)
        side.build_connector_meta(busy)
        assert side.counters.idle_waits == 0
        started = time.perf_counter()
        for _ in range(5):
            side.build_connector_meta(empty)
        assert time.perf_counter() - started >= 5 * IDLE_WAIT_S * 0.9  # (slept, not spun)
        assert side.counters.idle_waits == 5
    finally:
        server.unpause()
    started = time.perf_counter()
    assert side.lookups.wait_any(30)  # (returns when the lookup is ready, not at the limit)
    assert time.perf_counter() - started < 20
    assert side.get_num_new_matched_tokens(remote, 0) == (4 * BLOCK, True)
    side.loads.pop("r-remote").cache.close()
    side.shutdown()


class EngineCore:
    """Stands for vLLM's engine core (`EngineCoreProc`): its steps run the connector's
    scheduler side, and requests arrive on its input queue meanwhile."""

    def __init__(self, side: SchedulerSide) -> None:
        self.input_queue: queue.Queue[tuple[str, object]] = queue.Queue()
        self.side = side

    def step(self, output: object) -> None:
        self.side.build_connector_meta(output)


def test_an_empty_step_in_an_engine_core_pauses_until_a_request_arrives(server, monkeypatch):
    """Inside vLLM's engine core (its input queue seen), an empty step with a lookup waiting
    pauses longer (IDLE_WAIT_WATCHED_S: fewer empty steps, each a call to every worker), and
    the engine's input ends the pause: a request arriving meanwhile is not held by it."""
    remote = written_by_another_engine(server.url)

    side = scheduler_for(server.url)
    engine = EngineCore(side)
    empty = SimpleNamespace(total_num_scheduled_tokens=0, num_scheduled_tokens={})
    server.pause()
    try:
        assert side.get_num_new_matched_tokens(remote, 0) == (None, False)
        started = time.perf_counter()
        engine.step(empty)
        assert time.perf_counter() - started >= IDLE_WAIT_WATCHED_S * 0.9
        engine.input_queue.put(("add", "r-local"))  # (waiting already: no pause)
        started = time.perf_counter()
        engine.step(empty)
        assert time.perf_counter() - started < IDLE_WAIT_WATCHED_S * 0.9
        engine.input_queue.get()
        monkeypatch.setattr(idle_module, "IDLE_WAIT_WATCHED_S", 30.0)
        arrival = threading.Timer(0.05, engine.input_queue.put, [("add", "r-local")])
        arrival.start()  # (a request arriving during the pause ends it)
        started = time.perf_counter()
        engine.step(empty)
        assert time.perf_counter() - started < 10
        assert not engine.input_queue.empty()
        assert side.counters.idle_waits == 3
    finally:
        server.unpause()
    assert side.lookups.wait_any(30)
    started = time.perf_counter()
    engine.input_queue.get()
    engine.step(empty)  # (a lookup ready: no pause; the request's answer is on its next ask)
    assert time.perf_counter() - started < 10
    assert side.get_num_new_matched_tokens(remote, 0) == (4 * BLOCK, True)
    side.loads.pop("r-remote").cache.close()
    side.shutdown()


def test_a_server_that_dies_during_a_lookup_costs_its_hits_only(server):
    remote = written_by_another_engine(server.url)

    side = scheduler_for(server.url, remote_timeout_ms=200)
    server.pause()
    assert side.get_num_new_matched_tokens(remote, 0) == (None, False)
    lookahead = side.lookups._waiting["r-remote"]
    assert lookahead.wait(10)  # (the call timed out: no answer)
    server.unpause()
    assert side.get_num_new_matched_tokens(remote, 0) == (0, False)  # a miss, never a wait
    assert side.manager.num_open_kv_caches == 0
    side.shutdown()


def test_synchronous_lookups_still_answer_at_once(server):
    remote = written_by_another_engine(server.url)
    side = scheduler_for(server.url, async_lookups=False)
    assert side.get_num_new_matched_tokens(remote, 0) == (4 * BLOCK, True)
    assert side.lookups.started == 0
    side.loads.pop("r-remote").cache.close()
    side.shutdown()
