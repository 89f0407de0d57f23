"""KV events as a router meets them: a subscriber in another process decodes the ZMQ stream
(with vLLM's own classes where vLLM is installed, else with structs written from the wire format
alone), rebuilds the cached blocks per medium and, at checkpoints, equals the manager's own view
exactly: through commits, the eviction cascade, suspension, rebalancing, a level resized,
clear_reusable_blocks, and for a subscriber that joins late and replays."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

import pytest

pytest.importorskip("msgspec")
pytest.importorskip("zmq")

from kvpool import (
    ConfigError,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    KVEventsConfig,
    ReuseScope,
)
from kvpool.events import cached_blocks
from kvpool.events.wire import BlockStored, block_hash, decode_batch
from tests.engine_check import CheckingEngine
from tests.helpers import MiB, make_config, record_layer, shutdown

TPB = 16
SUBSCRIBER = Path(__file__).with_name("kv_event_subscriber.py")
PEER_PYTHON = Path("/tmp/peervenv/bin/python")
# Two layer groups in two pool groups: full attention (80 KiB pages) and a window of 32 tokens
# with 4 sinks (64 KiB pages).
LAYERS = [
    record_layer(0, TPB, repeats=64),
    record_layer(1, TPB, repeats=64),
    record_layer(2, TPB, window=32, sinks=4, repeats=64),
    record_layer(3, TPB, window=32, sinks=4, repeats=64),
    record_layer(4, TPB, repeats=32),
]
EVENTS = KVEventsConfig("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")


@cache
def vllm_available() -> bool:
    if not PEER_PYTHON.exists():
        return False
    check = [str(PEER_PYTHON), "-c", "import vllm.distributed.kv_events"]
    return subprocess.run(check, capture_output=True, timeout=120).returncode == 0


DECODERS = ["independent", "vllm"]


class Subscriber:
    """The subscriber process; `view(n)` once batch n was applied."""

    def __init__(self, endpoints, decoder):
        python = str(PEER_PYTHON) if decoder == "vllm" else sys.executable
        self.process = subprocess.Popen(
            [python, str(SUBSCRIBER), *endpoints, decoder],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert json.loads(self.process.stdout.readline()) == {"ready": True}

    def view(self, sequence):
        self.process.stdin.write(f"view {sequence}\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self):
        if self.process.poll() is None:
            self.process.stdin.write("quit\n")
            self.process.stdin.flush()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()


@pytest.fixture
def subscribers():
    made = []

    def start(manager, decoder):
        subscriber = Subscriber(manager.kv_event_endpoints, decoder)
        made.append(subscriber)
        return subscriber

    yield start
    for subscriber in made:
        subscriber.close()


def checkpoint(manager, *subscribers):
    """Every subscriber's view equals the manager's, with no inconsistent event seen."""
    manager.flush_kv_events()
    last = manager._kv_events.num_batches - 1
    expected = cached_blocks(manager)
    for subscriber in subscribers:
        got = subscriber.view(last)
        assert got["errors"] == [] and got["applied"] == last
        assert {m: {tuple(p) for p in pairs} for m, pairs in got["media"].items()} == {
            m: pairs for m, pairs in expected.items() if pairs
        }
    return expected


def run(manager, engine, tokens, scope=None):
    """One request over `tokens`, one engine step per block (events flushed per step)."""
    cache = manager.create_kv_cache(scope, tokens[:-1])
    assert cache.resume()
    for start in range(cache.num_committed_tokens, len(tokens), TPB):
        assert engine.step(cache, tokens, tokens[start : start + TPB])
        manager.flush_kv_events()
    engine.check(cache, tokens)
    cache.close()


def prompt(n, blocks=4):
    return [n * 1000 + i for i in range(blocks * TPB)]


@pytest.mark.parametrize("decoder", DECODERS)
def test_a_router_in_another_process_sees_exactly_what_the_manager_caches(
    tmp_path, subscribers, decoder
):
    if decoder == "vllm" and not vllm_available():
        pytest.skip("vLLM is not installed (../shared/bench/peers/setup.sh builds it)")
    tiers = [
        GpuCacheTierConfig(8 * MiB),
        HostCacheTierConfig(8 * MiB),
        DiskCacheTierConfig(8 * MiB, str(tmp_path)),
    ]
    m = KVCacheManager(make_config(LAYERS, tiers, TPB, kv_events=EVENTS))
    try:
        engine = CheckingEngine(m)
        early = subscribers(m, decoder)
        for n in range(4):  # commits (a LoRA scope among them)
            run(m, engine, prompt(n), ReuseScope(lora_id=7) if n == 3 else None)
        view = checkpoint(m, early)
        assert {group for _, group in view["GPU"]} == {0, 1} and len(view["GPU"]) >= 4 * 4 + 4 * 3
        for n in range(4, 40):  # the cascade: GPU -> host -> disk -> dropped
            run(m, engine, prompt(n))
        storage = m._storage.state
        assert storage.num_moved[1] and storage.num_moved[2] and m.num_dropped_pages
        view = checkpoint(m, early)
        assert set(view) == {"GPU", "CPU", "DISK"}
        # a held request suspended and pushed down by others, then resumed
        held = m.create_kv_cache(None, prompt(40)[:-1])
        assert held.resume() and engine.step(held, prompt(40), prompt(40)[held.history_length :])
        held.suspend()
        for n in range(41, 70):
            run(m, engine, prompt(n))
        assert any(p.level > 0 for p in held.pages(0) if p is not None)
        late = subscribers(m, decoder)  # joins late: replays from the first batch
        checkpoint(m, early, late)
        assert held.resume()
        engine.check(held, prompt(40))
        held.close()
        checkpoint(m, early, late)
        # rebalancing moves pages between slots (same medium) and may push or drop some
        before = m.get_slot_counts(0)
        m.adjust_cache_level(0, [0.2, 0.8])
        assert m.get_slot_counts(0) != before
        checkpoint(m, early, late)
        assert m.resize(1, 6 * MiB)  # the host level shrinks: pages to disk or dropped
        checkpoint(m, early, late)
        m.clear_reusable_blocks()
        assert checkpoint(m, early, late) == {}
        run(m, engine, prompt(60))
        checkpoint(m, early, late)
        assert early.view(m._kv_events.num_batches - 1)["events"] > 100
    finally:
        shutdown(m)


def test_batches_merge_a_committed_chain_and_carry_tokens_scope_and_medium(subscribers):
    m = KVCacheManager(
        make_config([record_layer(0, TPB)], [GpuCacheTierConfig(2 * MiB)], TPB, kv_events=EVENTS)
    )
    import zmq

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(m.kv_event_endpoints[0])
    try:
        engine = CheckingEngine(m)
        tokens = prompt(1, blocks=3)
        scope = ReuseScope(lora_id=5, salt="tenant")
        for _ in range(50):  # (a SUB socket misses what is sent before it is connected)
            cache = m.create_kv_cache(scope, [])
            assert cache.resume() and engine.step(cache, tokens, tokens)  # one step, 3 blocks
            cache.close()
            m.clear_reusable_blocks()
            m.flush_kv_events()
            if sub.poll(200):
                break
        topic, sequence, payload = sub.recv_multipart()
        assert topic == b"" and len(sequence) == 8
        batch = decode_batch(payload)
        assert batch.data_parallel_rank == 0 and batch.ts > 0
        stored, cleared = batch.events
        assert isinstance(stored, BlockStored) and type(cleared).__name__ == "AllBlocksCleared"
        keys = [block.key for block in m._tree.index.values()]  # (cleared: recompute the keys)
        assert keys == []
        from hashlib import sha256

        from kvpool.tokens import encode_checked, root_key

        key, hashes = root_key(scope), []
        for i in range(3):
            key = sha256(key + encode_checked(tokens[i * TPB : (i + 1) * TPB])).digest()
            hashes.append(block_hash(key))
        assert stored.block_hashes == hashes and stored.parent_block_hash is None
        assert stored.token_ids == tokens and stored.block_size == TPB
        assert stored.lora_id == 5 and stored.extra_keys == [("tenant",)] * 3
        assert stored.medium == "GPU" and stored.group_idx == 0
    finally:
        sub.close(linger=0)
        shutdown(m)


def test_no_events_cost_nothing_and_bad_event_config_is_refused_by_field():
    m = KVCacheManager(make_config([record_layer(0, TPB)], [GpuCacheTierConfig(2 * MiB)], TPB))
    assert m.kv_event_endpoints is None and m._tree.kv_events is None
    m.flush_kv_events()  # a no-op
    shutdown(m)
    for fields, named in [
        (dict(endpoint="nowhere"), "kv_events.endpoint"),
        (dict(replay_endpoint=5), "kv_events.replay_endpoint"),
        (dict(buffer_steps=0), "kv_events.buffer_steps"),
        (dict(data_parallel_rank=-1), "kv_events.data_parallel_rank"),
        (dict(topic=b"x"), "kv_events.topic"),
    ]:
        config = make_config(kv_events=KVEventsConfig(**fields))
        with pytest.raises(ConfigError, match=named):
            KVCacheManager(config)
    taken = KVCacheManager(make_config(kv_events=EVENTS))
    try:
        pub, replay = taken.kv_event_endpoints
        # Issue 30: a bind that fails names its field (it named neither), before any state.
        for fields, named in [
            (dict(endpoint=pub), "kv_events.endpoint"),
            (
                dict(endpoint="tcp://127.0.0.1:0", replay_endpoint=replay),
                "kv_events.replay_endpoint",
            ),
            (dict(endpoint="nosuch://x"), "kv_events.endpoint"),
            (dict(endpoint="tcp://nosuchinterface0:5557"), "kv_events.endpoint"),
            (
                dict(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://nosuchinterface0:1"),
                "kv_events.replay_endpoint",
            ),
        ]:
            with pytest.raises(ConfigError) as caught:
                KVCacheManager(make_config(kv_events=KVEventsConfig(**fields)))
            message = str(caught.value)
            assert message.startswith(named) and "is invalid: must be an address" in message
    finally:
        shutdown(taken)


def test_a_start_that_fails_on_its_replay_port_releases_its_pub_port():
    """Every failed start releases all it took: a retry in the same process binds the same PUB
    endpoint at once, even while the first failure's exception (and its frames) is kept."""
    import socket

    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        pub = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    kept = []
    try:
        taken = f"tcp://127.0.0.1:{blocker.getsockname()[1]}"
        with pytest.raises(ConfigError, match=r"kv_events\.replay_endpoint") as caught:
            KVCacheManager(make_config(kv_events=KVEventsConfig(pub, replay_endpoint=taken)))
        kept.append(caught.value)  # (a caller that logs and keeps the error)
        retry = KVCacheManager(
            make_config(kv_events=KVEventsConfig(pub, replay_endpoint="tcp://127.0.0.1:0"))
        )
        assert retry.kv_event_endpoints[0] == pub
        shutdown(retry)
    finally:
        blocker.close()


def test_pages_swapped_through_ram_are_announced_on_their_new_medium(subscribers):
    """Every level nearly full of held pages: resuming swaps pages with those it pushes down
    (the staged path), and the subscriber still equals the manager."""
    layers = [record_layer(i, TPB, repeats=64) for i in range(2)]  # 64 KiB pages, 32 per 2 MiB
    tiers = [GpuCacheTierConfig(2 * MiB), HostCacheTierConfig(2 * MiB)]
    m = KVCacheManager(make_config(layers, tiers, TPB, kv_events=EVENTS))
    try:
        engine = CheckingEngine(m)
        subscriber = subscribers(m, "independent")
        requests = []
        for i in range(3):  # 3 x 20 held pages of the 64 slots
            tokens = [i * 1000 + t for t in range(20 * TPB)]
            cache = m.create_kv_cache()
            assert cache.resume() and engine.step(cache, tokens, tokens)
            cache.suspend()
            requests.append((cache, tokens))
        checkpoint(m, subscriber)
        for cache, tokens in requests:
            assert cache.resume()
            engine.check(cache, tokens)
            cache.suspend()
            checkpoint(m, subscriber)
        assert m._storage.state.num_swapped > 0
        for cache, _ in requests:
            cache.close()
        checkpoint(m, subscriber)
    finally:
        shutdown(m)


def test_blocks_written_to_the_remote_tier_are_announced_as_external(tmp_path, subscribers):
    from kvpool import RemoteCacheTierConfig
    from tests.valkey_servers import ValkeyServer, server_binary

    if server_binary() is None:
        pytest.skip("no valkey-server binary")
    server = ValkeyServer(tmp_path / "valkey").start()
    layers = [record_layer(i, TPB, repeats=64) for i in range(2)]  # 32 pages per 2 MiB
    config = make_config(
        layers,
        [GpuCacheTierConfig(2 * MiB)],
        TPB,
        kv_events=EVENTS,
        remote_tier=RemoteCacheTierConfig(server.url),
    )
    m = KVCacheManager(config)
    try:
        engine = CheckingEngine(m)
        subscriber = subscribers(m, "independent")
        for n in range(12):  # 48 blocks through 32 slots: 16 or more leave for the server
            run(m, engine, prompt(n))
        assert m.flush_remote_writes(10)
        m.flush_kv_events()
        view = subscriber.view(m._kv_events.num_batches - 1)
        assert view["errors"] == []
        external = {tuple(pair) for pair in view["media"].pop("EXTERNAL")}
        assert {m: {tuple(p) for p in pairs} for m, pairs in view["media"].items()} == (
            cached_blocks(m)
        )
        written = m.remote_statistics().written_values
        assert len(external) == written >= 16
        assert not external & cached_blocks(m)["GPU"]  # dropped there, stored on EXTERNAL
    finally:
        shutdown(m)
        server.stop()


@pytest.mark.parametrize("envelope", [True, False], ids=["empty-frame-first", "start-alone"])
def test_a_dealer_replays_every_kept_batch_then_the_end_marker(envelope):
    """What the README documents, exactly: a DEALER sends the start sequence (after an empty
    frame, vLLM's form, or alone) and receives every kept batch from there on, one message
    each, then sequence -1. (Issue 30: the README said "DEALER or REQ"; a REQ sees the first
    batch only, and a DEALER sending the start alone got nothing.)"""
    import zmq

    m = KVCacheManager(make_config([record_layer(0, TPB)], [GpuCacheTierConfig(2 * MiB)], TPB,
                                   kv_events=EVENTS))  # fmt: skip
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        engine = CheckingEngine(m)
        for n in range(5):
            run(m, engine, prompt(n, 2))  # one batch per block: 10 batches
        m.flush_kv_events()
        for _ in range(500):  # (until the publisher's thread has sent and kept them all)
            if m._publisher.num_batches == m._kv_events.num_batches:
                break
            time.sleep(0.01)
        dealer.connect(m.kv_event_endpoints[1])
        dealer.send_multipart(
            [b"", (3).to_bytes(8, "big")] if envelope else [(3).to_bytes(8, "big")]
        )
        sequences, stored = [], 0
        while True:
            assert dealer.poll(5000), "no reply"
            frames = dealer.recv_multipart()
            if envelope:
                assert frames[0] == b""
                frames = frames[1:]
            topic, sequence_bytes, payload = frames
            sequence = int.from_bytes(sequence_bytes, "big", signed=True)
            if sequence < 0:
                assert topic == b"" and payload == b""
                break
            assert topic == EVENTS.topic.encode()
            sequences.append(sequence)
            stored += sum(isinstance(e, BlockStored) for e in decode_batch(payload).events)
        last = m._kv_events.num_batches - 1
        assert sequences == list(range(3, last + 1)) and last >= 9 and stored > 0
    finally:
        dealer.close(linger=0)
        shutdown(m)
