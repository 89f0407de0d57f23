"""The shared tier on real Valkey clusters (started on free ports by `tests.valkey_servers`):
a failed node costs the prompts it holds, not the others'; a stalled node costs a call at most
its timeout, then is skipped; a restarted node is rejoined; a resharding (ASK, then MOVED) is
followed without a restart; a killed primary's replica serves its prompts after the failover;
two processes share the cluster through it. Every reused byte is checked (`CheckingEngine`).

Clusters are shared per module (start-ups cost seconds): the tests run in file order, and each
leaves its cluster whole for the next."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from tests.test_remote import (  # noqa: F401 (the fixture)
    TPB,
    compute,
    fill_remote,
    managers,
    prompt_of,
    stored_value_keys,
)
from tests.valkey_servers import (
    ValkeyServer,
    cluster_nodes,
    move_slots,
    node_id,
    server_binary,
    start_cluster,
    wait_for,
)

pytestmark = pytest.mark.skipif(server_binary() is None, reason="no valkey-server binary")

PROMPTS = 24
BLOCKS = 3
TIMEOUT_MS = 250


@pytest.fixture(scope="module")
def primaries(tmp_path_factory):
    nodes = start_cluster(tmp_path_factory.mktemp("cluster3"), 3)
    yield nodes
    for node in nodes:
        node.stop()


@pytest.fixture(scope="module")
def with_replicas(tmp_path_factory):
    nodes = start_cluster(tmp_path_factory.mktemp("cluster6"), 3, replicas=1)
    yield nodes
    for node in nodes:
        node.stop()


def seeds(nodes: list[ValkeyServer]) -> list[str]:
    return [node.url.rsplit("/", 1)[0] for node in nodes]


def holder(nodes, key: bytes) -> int:
    """The index of the node that holds `key` (-1: none)."""
    for i, node in enumerate(nodes):
        if node.process is not None and node.answers():
            client = node.client()
            try:
                if client.execute_command("EXISTS", key) == 1:
                    return i
            except Exception:  # (MOVED and the like: not there)
                pass
            finally:
                client.close()
    return -1


def filled(managers, nodes, namespace: str, **remote):  # noqa: F811
    """A writer's prompts, all in the cluster, and the node each one lives on (its chain is
    whole on one node: placement_tokens=0)."""
    remote.setdefault("placement_tokens", 0)
    a, engine_a = managers(seeds(nodes), namespace=namespace, timeout_ms=TIMEOUT_MS, **remote)
    prompts = [prompt_of(n, BLOCKS) for n in range(PROMPTS)]
    fill_remote(a, engine_a, prompts)
    where = []
    for tokens in prompts:
        keys = [k for per_block in stored_value_keys(None, a, tokens) for k in per_block]
        places = {holder(nodes, key) for key in keys}
        assert len(places) == 1 and -1 not in places, places  # the chain is whole, on one node
        where.append(places.pop())
    assert len(set(where)) == 3, where  # (spread over the three primaries)
    return a, prompts, where


def reader(managers, nodes, namespace: str, **remote):  # noqa: F811
    remote.setdefault("placement_tokens", 0)
    return managers(seeds(nodes), namespace=namespace, timeout_ms=TIMEOUT_MS, **remote)


def reuse(m, engine, prompts) -> list[int]:
    """Blocks each prompt reused (its last block is recomputed: at most BLOCKS - 1), each call
    bounded by the timeout (twice: a stalled node's pipeline and the slot map's read)."""
    out = []
    for tokens in prompts:
        started = time.monotonic()
        out.append(compute(m, engine, tokens + [1]) // TPB)
        assert time.monotonic() - started < 2 * TIMEOUT_MS / 1000 + 1.0  # (a loaded CI)
    return out


def node_stats(m):
    return m._remote.store.cluster.stats


def read_in_process(urls, namespace, prompts, result):  # (a spawned engine process)
    from kvpool import GpuCacheTierConfig, KVCacheManager, RemoteCacheTierConfig
    from tests.engine_check import CheckingEngine
    from tests.helpers import make_config, shutdown
    from tests.test_remote import FULL, MiB

    remote = RemoteCacheTierConfig(urls, namespace=namespace, timeout_ms=TIMEOUT_MS,
                                   placement_tokens=0)  # fmt: skip
    m = KVCacheManager(make_config(layers=FULL, tokens_per_block=TPB,
                                   tiers=[GpuCacheTierConfig(2 * MiB)], remote_tier=remote))  # fmt: skip
    engine = CheckingEngine(m)
    got = reuse(m, engine, prompts)
    stats = m.remote_statistics()
    result.put((got, engine.records_checked, stats.missing_values, stats.corrupt_values))
    shutdown(m)


def another_process_reads(nodes, namespace, prompts):
    """What a reader in another engine process reuses of each prompt (every record checked)."""
    context = multiprocessing.get_context("spawn")
    result = context.Queue()
    process = context.Process(
        target=read_in_process, args=(seeds(nodes), namespace, prompts, result)
    )
    process.start()
    got, checked, missing, corrupt = result.get(timeout=60)
    process.join(10)
    assert process.exitcode == 0 and checked > 0 and missing == corrupt == 0
    return got


# -- three primaries -----------------------------------------------------------------------------


def test_a_prompt_lives_in_two_parts_its_first_blocks_and_the_rest(primaries, managers):  # noqa: F811
    """placement_tokens=4 blocks: blocks 0-3 in the slot of block 0, blocks 4.. in that of
    block 4; the reader's lookup computes the same tags from a local prefix of any length."""
    from valkey.crc import key_slot

    a, engine_a = managers(seeds(primaries), namespace="parts", placement_tokens=4 * TPB)
    prompts = [prompt_of(100 + n, 9) for n in range(6)]
    fill_remote(a, engine_a, prompts)
    for tokens in prompts:
        keys = [per_block[0] for per_block in stored_value_keys(None, a, tokens)]
        slots = [key_slot(key) for key in keys]
        assert len(set(slots[:4])) == 1 and len(set(slots[4:])) == 1, slots
        assert all(holder(primaries, key) >= 0 for key in keys)  # (the keys a wrote)
    b, engine_b = managers(seeds(primaries), namespace="parts", placement_tokens=4 * TPB)
    for local in (0, 2, 4, 6):  # b fetches the first `local` blocks, then the rest
        tokens = prompts[local // 2]
        if local:
            assert compute(b, engine_b, tokens[: local * TPB] + [1]) == local * TPB
        assert compute(b, engine_b, tokens + [1]) == 9 * TPB
    stats = b.remote_statistics()
    assert stats.fetched_blocks == 4 * 9 and stats.missing_values == 0
    # the same through a look-ahead (its query carries the local prefix's last tag)
    d, engine_d = managers(seeds(primaries), namespace="parts", placement_tokens=4 * TPB)
    for local in (3, 6):
        tokens = prompts[local - 2]
        assert compute(d, engine_d, tokens[: local * TPB] + [1]) == local * TPB
        lookahead = d.look_ahead(None, tokens)
        assert lookahead.wait(10) and lookahead.remote is not None
        assert lookahead.remote.start == local and lookahead.remote.end == 9
        cache = d.create_kv_cache(None, tokens, lookahead=lookahead)
        assert cache.resume() and cache.num_committed_tokens == 9 * TPB
        engine_d.check(cache, tokens)
        cache.close()
    # another layout's keys are others: a reader spreading blocks one by one finds nothing
    c, _ = managers(seeds(primaries), namespace="parts", placement_tokens=None)
    assert c.probe_reuse(None, prompts[5]) == 0


def test_replay_reports_each_node_of_the_cluster(primaries, tmp_path, capsys, monkeypatch):
    import json

    from kvpool import _debug
    from kvpool.cli import main
    from tests.helpers import write_tiny_hf_config

    monkeypatch.setattr(_debug, "DEBUG", False)
    model = write_tiny_hf_config(tmp_path)
    out = tmp_path / "run.json"
    argv = ["replay", "--requests", "20", "--hf-config", str(model), "--gpu", "2MiB"]
    argv += ["--host", "0", "--no-progress", "--remote", *seeds(primaries), "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    nodes = json.loads(out.read_text())["report"]["remote_nodes"]
    addresses = [f"127.0.0.1:{n.port}" for n in primaries]
    assert list(nodes) == addresses
    for address in addresses:
        assert nodes[address]["calls"] > 0 and nodes[address]["errors"] == 0
        assert f"node {address}" in printed


def test_info_lists_the_nodes_of_the_cluster_and_refuses_a_bad_url(primaries, capsys):
    from kvpool.cli import main

    assert main(["info", "--remote", seeds(primaries)[1]]) == 0  # (one seed is enough)
    printed = capsys.readouterr().out
    assert "3 node(s)" in printed
    for node in primaries:
        line = next(x for x in printed.splitlines() if f"127.0.0.1:{node.port} " in x)
        keys = node.client().dbsize()
        assert "primary: 5461 slots" in line or "primary: 5462 slots" in line
        assert f"{keys:,} keys" in line
    with pytest.raises(SystemExit) as exit_:
        main(["info", "--remote", "http://x:1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--remote" in err and err.count("\n") == 1


def test_a_stalled_node_costs_its_prompts_for_a_timeout_then_is_skipped_and_rejoined(
    primaries,
    managers,  # noqa: F811
):
    _, prompts, where = filled(managers, primaries, "stall")
    b, engine_b = reader(managers, primaries, "stall", reconnect_min_ms=200)
    stalled = where[0]
    primaries[stalled].pause()
    try:
        got = reuse(b, engine_b, prompts)
    finally:
        primaries[stalled].unpause()
    expected = [0 if node == stalled else BLOCKS for node in where]
    assert got == expected  # (every byte of the others' checked by the engine)
    stats = b.remote_statistics()
    address = f"127.0.0.1:{primaries[stalled].port}"
    assert node_stats(b)[address].errors >= 1 and node_stats(b)[address].skipped_calls >= 1
    assert stats.errors >= 1 and stats.skipped_calls >= 1
    assert stats.missing_values == stats.corrupt_values == 0
    time.sleep(0.5)  # the back-off ends: the node answers again
    c, engine_c = reader(managers, primaries, "stall")
    assert reuse(c, engine_c, [p for p, n in zip(prompts, where, strict=True) if n == stalled]) == [
        BLOCKS
    ] * where.count(stalled)
    key = stored_value_keys(None, b, prompts[where.index(stalled)])[0][0]
    # b's back-off ends: it asks again
    wait_for(lambda: b._remote.store.exists([key]) == [True], "b did not ask the node again", 10)
    assert node_stats(b)[address].reconnects == 1
    # per node in Prometheus: the stalled one's errors and its latency (a timeout or more)
    prometheus_client = pytest.importorskip("prometheus_client")
    from kvpool.metrics import PrometheusMetrics
    from tests.helpers import prometheus_samples

    registry = prometheus_client.CollectorRegistry()
    metrics = PrometheusMetrics(b, registry=registry)
    samples = prometheus_samples(prometheus_client.generate_latest(registry).decode())
    metrics.close()
    nodes = b.remote_nodes()
    assert list(nodes)[:3] == [f"127.0.0.1:{n.port}" for n in primaries]  # (in slot order)
    for node in nodes:
        label = (("node", node),)
        errors = samples[("kvpool:remote_node_errors_total", label)]
        assert errors == nodes[node].errors and (errors >= 1 if node == address else errors == 0)
        assert samples[("kvpool:remote_node_calls_total", label)] == nodes[node].calls > 0
        bucket = (("le", "0.2"), ("node", node))
        slow = samples[("kvpool:remote_node_latency_seconds_count", label)]
        slow -= samples[("kvpool:remote_node_latency_seconds_bucket", bucket)]
        if node == address:
            assert slow >= 1  # (its timeout: 0.25 s)


def test_two_stalled_nodes_cost_a_call_one_timeout_not_two(primaries, managers):  # noqa: F811
    _, prompts, where = filled(managers, primaries, "two")
    b, _ = reader(managers, primaries, "two")
    keys = [stored_value_keys(None, b, prompts[where.index(node)])[0][0] for node in range(3)]
    assert b._remote.store.exists(keys) == [True] * 3  # (connections made, slot map read)
    primaries[0].pause()
    primaries[1].pause()
    try:
        started = time.monotonic()
        found = b._remote.store.exists(keys)
        took = time.monotonic() - started
    finally:
        primaries[0].unpause()
        primaries[1].unpause()
    assert found == [False, False, True]
    assert TIMEOUT_MS / 1000 <= took < 1.8 * TIMEOUT_MS / 1000, took  # (not one per node)
    errors = [node_stats(b)[f"127.0.0.1:{node.port}"].errors for node in primaries]
    assert errors == [1, 1, 0]


def test_a_node_stalled_between_lookup_and_fetch_is_a_failed_call_not_values_gone(
    primaries,
    managers,  # noqa: F811
):
    _, prompts, where = filled(managers, primaries, "between")
    b, engine_b = reader(managers, primaries, "between")
    tokens = [*prompts[0], 1]
    cache = b.create_kv_cache(None, tokens[:-1])  # the lookup finds the prompt on its node
    assert cache.num_committed_tokens == BLOCKS * TPB
    primaries[where[0]].pause()
    try:
        started = time.monotonic()
        assert cache.resume()  # the fetch: its node does not answer
        assert time.monotonic() - started < TIMEOUT_MS / 1000 + 0.5
    finally:
        primaries[where[0]].unpause()
    assert cache.num_committed_tokens == 0  # nothing half-fetched: recomputed
    engine_b.check(cache, tokens)
    assert engine_b.step(cache, tokens, tokens)
    cache.close()
    stats = b.remote_statistics()
    assert stats.errors == 1 and stats.missing_values == stats.corrupt_values == 0
    assert stats.fetched_blocks == 0


def test_a_resharding_is_followed_while_a_reader_runs(primaries, managers):  # noqa: F811
    _, prompts, where = filled(managers, primaries, "reshard")
    b, engine_b = reader(managers, primaries, "reshard")
    source = where[0]
    target = (source + 1) % 3
    moving = [p for p, n in zip(prompts, where, strict=True) if n == source]
    src = primaries[source].client()
    slots = sorted({src.cluster("KEYSLOT", stored_value_keys(None, b, p)[0][0]) for p in moving})
    src.close()
    assert b.probe_reuse(None, moving[0]) == BLOCKS * TPB  # (b read the slot map before)
    # half-way: the slots migrating, part of their keys moved (ASK for those)
    moved = move_slots(primaries[source], primaries[target], slots,
                       finish=False, keys_per_slot=1)  # fmt: skip
    assert moved > 0
    assert reuse(b, engine_b, moving[: len(moving) // 2]) == [BLOCKS] * (len(moving) // 2)
    # done: the slots belong to the target (MOVED for a reader with the old map)
    move_slots(primaries[source], primaries[target], slots)
    rest = moving[len(moving) // 2 :]
    c, engine_c = reader(managers, primaries, "reshard")
    c._remote.store.cluster.refresh(force=True)
    c._remote.store.cluster.slots = list(b._remote.store.cluster.slots)  # (a stale map)
    c._remote.store.cluster.slots[slots[0]] = f"127.0.0.1:{primaries[source].port}"
    assert reuse(c, engine_c, rest) == [BLOCKS] * len(rest)
    redirects = sum(s.redirects for s in node_stats(b).values())
    redirects += sum(s.redirects for s in node_stats(c).values())
    assert redirects >= 2
    stats = b.remote_statistics() + c.remote_statistics()
    assert stats.missing_values == stats.corrupt_values == stats.errors == 0
    # put the slots back for the next test
    move_slots(primaries[target], primaries[source], slots)


def read_rounds_in_process(urls, namespace, prompts, rounds, stop, result):  # (spawned)
    from kvpool import GpuCacheTierConfig, KVCacheManager, RemoteCacheTierConfig
    from tests.engine_check import CheckingEngine
    from tests.helpers import make_config, shutdown
    from tests.test_remote import FULL, MiB

    remote = RemoteCacheTierConfig(urls, namespace=namespace, timeout_ms=TIMEOUT_MS,
                                   placement_tokens=0)  # fmt: skip
    m = KVCacheManager(make_config(layers=FULL, tokens_per_block=TPB,
                                   tiers=[GpuCacheTierConfig(2 * MiB)], remote_tier=remote))  # fmt: skip
    engine = CheckingEngine(m)
    sums = []
    while not stop.is_set() and len(sums) < 500:
        sums.append(sum(reuse(m, engine, prompts)))
        m.clear_reusable_blocks()  # (the next round asks the cluster again)
        with rounds.get_lock():
            rounds.value += 1
    stats = m.remote_statistics()
    redirects = sum(s.redirects for s in m.remote_nodes().values())
    result.put((sums, engine.records_checked, stats.missing_values, stats.errors, redirects))
    shutdown(m)


def test_a_resharding_under_a_reader_in_another_process_costs_no_hit(primaries, managers):  # noqa: F811
    _, prompts, where = filled(managers, primaries, "reshard2")
    source = where[0]
    target = (source + 2) % 3
    moving = [p for p, n in zip(prompts, where, strict=True) if n == source]
    b = managers(seeds(primaries), namespace="reshard2", placement_tokens=0)[0]
    slots = sorted({key_slot_of(stored_value_keys(None, b, p)[0][0]) for p in moving})
    context = multiprocessing.get_context("spawn")
    rounds, stop, result = context.Value("i", 0), context.Event(), context.Queue()
    args = (seeds(primaries), "reshard2", moving, rounds, stop, result)
    process = context.Process(target=read_rounds_in_process, args=args)
    process.start()
    try:

        def after_another_round() -> None:
            seen = rounds.value
            wait_for(lambda: rounds.value >= seen + 2 or not process.is_alive(), "no rounds", 30)

        after_another_round()
        move_slots(primaries[source], primaries[target], slots, finish=False, keys_per_slot=1)
        after_another_round()  # (ASK for the moved keys)
        move_slots(primaries[source], primaries[target], slots)
        after_another_round()  # (MOVED)
        move_slots(primaries[target], primaries[source], slots)  # and back, for the next test
        after_another_round()
    finally:
        stop.set()
    sums, checked, missing, errors, redirects = result.get(timeout=30)
    process.join(10)
    assert process.exitcode == 0
    assert len(sums) >= 8 and sums == [BLOCKS * len(moving)] * len(sums)  # every round, whole
    assert checked > 0 and missing == errors == 0 and redirects >= 2


def key_slot_of(key: bytes) -> int:
    from valkey.crc import key_slot

    return int(key_slot(key))


def test_a_killed_node_costs_only_its_prompts_and_is_rejoined_after_a_restart(
    primaries,
    managers,  # noqa: F811
):
    _, prompts, where = filled(managers, primaries, "kill")
    dead = where[0]
    primaries[dead].kill()
    try:
        other = primaries[(dead + 1) % 3].client()
        dead_id_known = [f for f in cluster_nodes(other) if f[1].endswith(f":{primaries[dead].port}")
                         or f":{primaries[dead].port}@" in f[1]]  # fmt: skip
        assert dead_id_known
        wait_for(lambda: any("fail" in f[2] for f in cluster_nodes(other) if f[0] == dead_id_known[0][0]),
                 "the cluster did not mark the node failed")  # fmt: skip
        other.close()
        # a fresh reader in another process, after the failure
        got = another_process_reads(primaries, "kill", prompts)
        assert got == [0 if node == dead else BLOCKS for node in where]
    finally:
        primaries[dead].start()  # same port, same nodes.conf: it rejoins, empty
    node = primaries[dead].client()
    wait_for(lambda: b"cluster_state:ok" in node.execute_command("CLUSTER", "INFO"),
             "the restarted node did not rejoin")  # fmt: skip
    node.close()
    # the writer's connection to it comes back; its prompts are written again and served
    lost = [p for p, n in zip(prompts, where, strict=True) if n == dead]
    c, engine_c = reader(managers, primaries, "kill2")
    fill_remote(c, engine_c, lost, None)
    assert c.remote_statistics().written_values == len(lost) * BLOCKS
    d, engine_d = reader(managers, primaries, "kill2")
    assert reuse(d, engine_d, lost) == [BLOCKS] * len(lost)


# -- primaries with replicas ---------------------------------------------------------------------


def test_a_killed_primary_costs_hits_only_until_its_replica_takes_over(
    with_replicas,
    managers,  # noqa: F811
):
    nodes = with_replicas
    _, prompts, where = filled(managers, nodes[:3], "failover")
    for i in range(3):  # every write is on the replica too
        client = nodes[i].client()
        assert client.execute_command("WAIT", 1, 5000) == 1
        client.close()
    dead = where[0]
    replica = nodes[3 + dead]
    nodes[dead].kill()
    b, engine_b = reader(managers, nodes, "failover", reconnect_min_ms=100, reconnect_max_ms=400)
    got = reuse(b, engine_b, prompts)  # during the failover: the dead primary's are misses
    assert [g for g, n in zip(got, where, strict=True) if n != dead] == [BLOCKS] * (
        PROMPTS - where.count(dead)
    )
    client = replica.client()
    wait_for(lambda: client.info("replication").get("role") == "master", "no failover")
    client.close()
    time.sleep(0.5)  # (the reader's back-off and the slot map's refresh)
    # b, running through it, follows the failover (its slot map read again after the failure)
    key = stored_value_keys(
        None, b, next(p for p, n in zip(prompts, where, strict=True) if n == dead)
    )[0][0]
    wait_for(lambda: b._remote.store.exists([key]) == [True], "b did not follow the failover", 5)
    # all of them, from the replica: for a new reader in another process, and one here
    assert another_process_reads(nodes, "failover", prompts) == [BLOCKS] * PROMPTS
    lost = [p for p, n in zip(prompts, where, strict=True) if n == dead]
    c, engine_c = reader(managers, nodes, "failover")
    assert reuse(c, engine_c, lost) == [BLOCKS] * len(lost)
    assert f"127.0.0.1:{replica.port}" in c._remote.store.cluster.primaries()
    assert node_id(nodes[(dead + 1) % 3].client())
