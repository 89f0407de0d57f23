"""A fuzzer driving kvpool's backend the way SGLang's cache controller does: write-backs
queued back to back (several batches in flight on the backup thread), prefetches (hit query,
then page transfer) while writes are in flight, and direct calls from other threads at the same
time, over prompts that share prefixes. Every page that arrives in SGLang's host pool is
checked byte for byte; with room for everything, a prompt's stored pages are all found."""

from __future__ import annotations

import random
import threading
from collections import Counter

import pytest

pytest.importorskip("sglang", reason="needs SGLang (scripts/test.sh runs this in its venv)")
torch = pytest.importorskip("torch")

from tests.sglang_backend.harness import PAGE, Engine, check_pages, fill_pages  # noqa: E402

MiB = 1 << 20
OPS = 40


def documents(rng: random.Random) -> list[list[int]]:
    """Prompts sharing prefixes: a few system prompts, each with several continuations."""
    found = []
    for _ in range(3):
        head = [rng.randrange(50000) for _ in range(PAGE * rng.randint(1, 3))]
        for _ in range(3):
            found.append(head + [rng.randrange(50000) for _ in range(PAGE * rng.randint(1, 4))])
    return found


def leading(hashes: list[str], stored: set[str]) -> int:
    n = 0
    while n < len(hashes) and hashes[n] in stored:
        n += 1
    return n


def at_once(engine: Engine, hashes: list[str], stored: set[str]) -> int:
    """`batch_exists` and `batch_get_v1` of the same pages from two threads at once."""
    backend, n = engine.backend, leading(hashes, stored)
    errors: list[BaseException] = []
    results: dict[str, object] = {}

    def exists() -> None:
        try:
            results["exists"] = backend.batch_exists(hashes)
        except BaseException as error:
            errors.append(error)

    def get() -> None:
        try:
            indices = engine.host.alloc(max(n, 1) * PAGE)
            results["got"] = backend.batch_get_v1(hashes[:n], indices[: n * PAGE])
            results["good"] = check_pages(engine, indices, hashes[:n])
            engine.host.free(indices)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=exists), threading.Thread(target=get)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert results["exists"] == n and results["got"] == [True] * n and results["good"] == n
    return n


@pytest.mark.parametrize(
    ("kind", "layout", "policy"),
    [("mha", "page_first", "write_through"), ("mla", "page_first_direct", "write_back")],
)
def test_fuzz_the_backend_as_the_controller_drives_it(tmp_path, request, kind, layout, policy):
    seed = request.config.getoption("--fuzz-seed")
    rng = random.Random(seed)
    extra = {"disk_bytes": 32 * MiB, "disk_path": str(tmp_path), "staging_bytes": 2 * MiB}
    engine = Engine(kind, layout, extra, write_policy=policy)
    controller, backend = engine.controller, engine.backend
    docs = documents(rng)
    stored: set[str] = set()
    checked = reads = 0
    actions: Counter[str] = Counter()
    for step in range(OPS):
        action = rng.choice(["writes", "read", "threads"])
        actions[action] += 1
        if action == "writes":  # batches queued back to back, a prefetch among them
            pending = []
            for _ in range(rng.randint(1, 3)):
                doc = rng.choice(docs)
                tokens = doc[: PAGE * rng.randint(1, len(doc) // PAGE)]
                indices = engine.host.alloc(len(tokens))
                hashes = engine.hashes(tokens)
                fill_pages(engine)(indices, hashes)
                op_id = controller.write_storage(indices, tokens, hash_value=hashes,
                                                 prefix_keys=[])  # fmt: skip
                pending.append((op_id, indices, hashes))
            loaded, got, loaded_hashes = engine.read(rng.choice(docs), rid=f"w{step}")
            if got is not None:
                assert check_pages(engine, got, loaded_hashes) == loaded // PAGE
                checked += loaded // PAGE
                engine.host.free(got)
            while pending:
                ack = controller.ack_backup_queue.get(timeout=60)
                for item in [p for p in pending if p[0] == ack.id]:
                    assert ack.completed_tokens == len(item[2]) * PAGE
                    stored.update(item[2])
                    engine.host.free(item[1])
                    pending.remove(item)
        elif action == "read":  # nothing in flight: every stored leading page is found
            doc = rng.choice(docs)
            want = leading(engine.hashes(doc), stored)
            loaded, got, loaded_hashes = engine.read(doc, rid=f"r{step}")
            assert loaded // PAGE == want, (step, loaded, want)
            reads += 1
            if got is not None:
                assert check_pages(engine, got, loaded_hashes) == want
                checked += want
                engine.host.free(got)
        else:  # SGLang's threads and others calling at once
            checked += at_once(engine, engine.hashes(rng.choice(docs)), stored)
    stats = backend.statistics()
    engine.close()
    assert len(actions) == 3 and reads > 0 and checked > 0  # (it reached what it checks)
    assert stats["stored_pages"] + stats.get("present_pages", 0) >= len(stored)
    assert stats.get("corrupt_pages", 0) == stats.get("failures", 0) == 0
