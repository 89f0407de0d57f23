"""The connector's scheduler and worker sides driven the way vLLM's scheduler drives them, by
random request streams: arrivals sharing prefixes, lookups, allocations, asynchronous loads,
finishes (saves), aborts while a load is in flight, preemptions, and injected copy failures on
the worker. A small simulated vLLM holds real KV tensors whose every block is a function of
the tokens before it, so a load that delivered wrong KV is caught on the spot. kvpool's first
level is small and backed by a disk level, so pages are evicted and brought back throughout.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs vLLM (scripts/test.sh runs this in its vLLM venv)")
torch = pytest.importorskip("torch")

from kvpool.integrations.vllm.scheduler import SchedulerSide  # noqa: E402
from kvpool.integrations.vllm.settings import ConnectorSettings, PageFormat  # noqa: E402
from kvpool.integrations.vllm.worker import WorkerSide, block_view  # noqa: E402
from kvpool.layout import KVLayout  # noqa: E402

BLOCK = 16
PAGE = PageFormat(("l0", "l1"), BLOCK, 2, 64, 4, 0, 1)  # 32 KiB per block: 64 per 2 MiB
NUM_BLOCKS = 96  # vLLM's pool


def block_value(request: Request, block: int) -> float:
    """What the simulated model writes into block `block`: a function of its whole prefix and
    its reuse scope (a hit across salts would load another value)."""
    prefix = tuple(request.all_token_ids[: (block + 1) * BLOCK])
    return float(hash((request.cache_salt, prefix)) % 1_000_003)


@dataclass
class Request:
    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None
    num_computed_tokens: int = 0
    lora_request: None = None
    mm_features: list[object] = field(default_factory=list)
    prompt_embeds: None = None
    block_ids: list[int] = field(default_factory=list)
    state: str = "waiting"  # waiting, loading, running, saving


class Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int]]:
        return (self.ids,)


class Simulation:
    def __init__(self, seed: int, tmp_path, fail_rate: float = 0.1) -> None:
        self.rng = random.Random(seed)
        (tmp_path / "disk").mkdir(parents=True, exist_ok=True)
        settings = ConnectorSettings.parse(
            {
                "host_bytes": 2 << 20,
                "disk_bytes": 4 << 20,
                "disk_path": str(tmp_path / "disk"),
            }
        )
        self.scheduler = SchedulerSide(settings, PAGE, "fuzz-model")
        self.scheduler.manager.record_decisions()
        config = PAGE.manager_config(settings, "fuzz-model")
        self.worker = WorkerSide(PAGE, NUM_BLOCKS, KVLayout(config.layers, BLOCK))
        shape = (NUM_BLOCKS, 2, PAGE.local_heads, BLOCK, PAGE.head_size)
        self.kv = {name: torch.zeros(shape) for name in PAGE.layer_names}
        self.worker.register_kv_caches(self.kv)
        self.free = list(range(NUM_BLOCKS))
        self.requests: dict[str, Request] = {}
        self.documents = [[self.rng.randrange(5000) for _ in range(BLOCK * 12)] for _ in range(4)]
        self.fail_rate = fail_rate
        self.next_id = 0
        self.loaded_blocks = 0
        self.failed_loads = 0
        self.verified_blocks = 0

    # -- the simulated engine ------------------------------------------------------------
    def compute(self, request: Request, start: int) -> None:
        for block in range(start // BLOCK, len(request.block_ids)):
            value = block_value(request, block)
            for tensor in self.kv.values():
                tensor[request.block_ids[block]] = value
        request.num_computed_tokens = len(request.all_token_ids) - 1

    def verify(self, request: Request, start: int, end: int) -> None:
        for block in range(start // BLOCK, end // BLOCK):
            expected = block_value(request, block)
            for tensor in self.kv.values():
                got = tensor[request.block_ids[block]]
                assert bool((got == expected).all()), f"wrong KV loaded for {request.request_id}"
            self.verified_blocks += 1

    def release(self, request: Request) -> None:
        self.free += request.block_ids
        request.block_ids = []

    # -- actions -------------------------------------------------------------------------
    def arrive(self) -> None:
        document = self.rng.choice(self.documents)
        cut = self.rng.randrange(BLOCK, len(document))
        tokens = document[:cut] + [self.rng.randrange(5000) for _ in range(self.rng.randrange(20))]
        salt = self.rng.choice([None, None, "tenant-b"])
        request = Request(f"r{self.next_id}", tokens, salt)
        self.next_id += 1
        self.requests[request.request_id] = request

    def schedule(self, request: Request) -> None:
        matched, is_async = self.scheduler.get_num_new_matched_tokens(request, 0)
        assert matched is not None and matched % BLOCK == 0
        assert matched < len(request.all_token_ids)
        assert is_async == (matched > 0)
        needed = -(-len(request.all_token_ids) // BLOCK)
        if needed > len(self.free):
            return  # stays waiting: asked again later (its kvpool pages stay held)
        request.block_ids = [self.free.pop() for _ in range(needed)]
        self.scheduler.update_state_after_alloc(request, Blocks(request.block_ids), matched)
        if matched:
            request.state = "loading"
            request.num_computed_tokens = matched
        else:
            self.compute(request, 0)
            request.state = "running"

    def finish(self, request: Request) -> None:
        delay, _ = self.scheduler.request_finished(request, list(request.block_ids))
        if delay:
            request.state = "saving"
        else:
            self.release(request)
            del self.requests[request.request_id]

    def step(self) -> None:
        meta = self.scheduler.build_connector_meta(None)
        failing = {
            t.request_id for t in meta.loads + meta.saves if self.rng.random() < self.fail_rate
        }
        original = self.worker._copy

        def copy(transfer, save):
            if transfer.request_id in failing:
                raise OSError("injected copy failure")
            original(transfer, save)

        self.worker._copy = copy  # (a plain Python class: the worker is not compiled)
        try:
            self.worker.start_load_kv(meta)
        finally:
            self.worker._copy = original
        sending, recving = self.worker.get_finished()
        errors = self.worker.take_load_errors()
        output = SimpleNamespace(
            finished_sending=sending,
            finished_recving=recving,
            kv_connector_worker_meta=self.worker.build_worker_meta(),
            invalid_block_ids=errors,
        )
        self.scheduler.update_connector_output(output)
        for request_id in recving or ():
            request = self.requests[request_id]
            if request.state == "aborted while loading":
                self.release(request)
                del self.requests[request_id]
                continue
            assert request.state == "loading"
            failed = errors & set(request.block_ids)
            if failed:
                self.failed_loads += 1
                self.compute(request, 0)  # vLLM recomputes
            else:
                self.loaded_blocks += request.num_computed_tokens // BLOCK
                self.verify(request, 0, request.num_computed_tokens)
                self.compute(request, request.num_computed_tokens)
            request.state = "running"
        for request_id in sending or ():
            request = self.requests.pop(request_id)
            self.release(request)

    def run(self, operations: int) -> None:
        for _ in range(operations):
            roll = self.rng.random()
            requests = list(self.requests.values())
            waiting = [r for r in requests if r.state == "waiting"]
            running = [r for r in requests if r.state == "running"]
            loading = [r for r in requests if r.state == "loading"]
            if roll < 0.25 or not requests:
                self.arrive()
            elif roll < 0.5 and waiting:
                self.schedule(self.rng.choice(waiting))
            elif roll < 0.7 and running:
                self.finish(self.rng.choice(running))
            elif roll < 0.75 and loading:  # aborted while its load is in flight: vLLM keeps
                request = self.rng.choice(loading)  # its blocks until the load is reported
                delay, _ = self.scheduler.request_finished(request, list(request.block_ids))
                assert not delay  # (nothing to save: its blocks may not hold their KV yet)
                request.state = "aborted while loading"
            elif roll < 0.8 and running:  # preempted: blocks freed, back to waiting
                request = self.rng.choice(running)
                self.release(request)
                request.state, request.num_computed_tokens = "waiting", 0
            elif roll < 0.85 and waiting:  # aborted before it ran
                request = self.rng.choice(waiting)
                self.scheduler.request_finished(request, [])
                del self.requests[request.request_id]
            else:
                self.step()
            self.scheduler.manager.check_invariants()

    def drain(self) -> None:
        for _ in range(200):
            for request in list(self.requests.values()):
                if request.state == "running":
                    self.finish(request)
                elif request.state == "waiting":
                    self.scheduler.request_finished(request, [])
                    del self.requests[request.request_id]
            self.step()
            if not self.requests:
                break
        assert not self.requests
        assert not self.scheduler.loads and not self.scheduler.saves
        assert self.scheduler.manager.num_open_kv_caches == 0
        assert sorted(self.free) == list(range(NUM_BLOCKS))


@pytest.mark.parametrize("seed", range(4))
def test_random_streams_never_load_wrong_kv_and_leave_nothing_behind(seed, tmp_path):
    simulation = Simulation(seed, tmp_path)
    simulation.run(1500)
    simulation.drain()
    counters = simulation.scheduler.counters
    # (the paths were reached: loads verified, evictions to disk, failed copies, saves)
    assert simulation.verified_blocks > 50
    assert simulation.failed_loads > 0 and counters.failed_saves > 0
    assert counters.hit_tokens_by_tier["disk"] > 0
    assert counters.saved_blocks > 50
    # (what vLLM's metrics get: the copies' bytes and the failed loads' blocks)
    counts = simulation.worker.counts
    assert counts["bytes_loaded"] >= simulation.verified_blocks * 2 * 2 * PAGE.buffer_bytes
    assert counts["bytes_saved"] >= counters.saved_blocks * 2 * 2 * PAGE.buffer_bytes
    assert counts["load_errors"] > 0
    assert simulation.scheduler.counts()["hit_tokens_disk"] == counters.hit_tokens_by_tier["disk"]
    simulation.scheduler.shutdown()


def test_same_calls_same_decisions(tmp_path):
    logs = []
    for run in range(2):
        simulation = Simulation(7, tmp_path / str(run))
        simulation.run(800)
        logs.append(simulation.scheduler.manager.take_decisions())
        simulation.scheduler.shutdown()
    assert logs[0] == logs[1] and len(logs[0]) > 100


def test_block_view_reads_the_cpu_layout_and_refuses_unknown_ones():
    page = PageFormat(("l0",), 32, 2, 64, 4, 0, 1)
    raw = torch.arange(3 * 2 * 32 * 128, dtype=torch.float32).view(3, 2, 32, 128)
    view = block_view(raw, 3, page)
    assert view.shape == (3, 2, 2, 32, 64)
    # K of block 1, head 0, token 5 is the first half of row 5; V the same row of the second half
    keys, values = raw.view(3, 2, 64, 64)[1, 0, :32], raw.view(3, 2, 64, 64)[1, 0, 32:]
    assert torch.equal(view[1, 0, 0], keys) and torch.equal(view[1, 1, 0], values)
    view[2, 1, 1, 3] = -1.0  # a view: writes reach vLLM's tensor
    assert bool((raw.view(3, 2, 64, 64)[2, 1, 32 + 3] == -1.0).all())
    with pytest.raises(ValueError, match="does not know this KV-cache layout"):
        block_view(torch.zeros(3, 4, 32, 128), 3, page)


def test_a_disk_read_error_at_lookup_is_a_miss_and_the_pages_survive(tmp_path, monkeypatch):
    from kvpool.storage.copier import Copier
    from kvpool.storage.memory import DiskMemory

    simulation = Simulation(3, tmp_path, fail_rate=0.0)
    scheduler = simulation.scheduler
    document = simulation.documents[0]
    first = Request("first", document[: 10 * BLOCK] + [1])
    simulation.requests["first"] = first
    simulation.schedule(first)
    simulation.finish(first)
    simulation.step()  # saved, committed
    # push its pages to disk: other prompts fill kvpool's first level
    for n in range(8):
        other = Request(f"other{n}", [50_000 + n * 1000 + i for i in range(10 * BLOCK)] + [1])
        simulation.requests[other.request_id] = other
        simulation.schedule(other)
        simulation.finish(other)
        simulation.step()
    probe = scheduler.manager.create_kv_cache(None, document[: 10 * BLOCK])
    levels = {page.level for page in probe.pages(0) if page is not None}
    probe.close()
    assert levels == {1}, "the test needs the first prompt's pages on disk"

    copy = Copier.copy

    def failing(self, source, destination, pairs):
        if any(isinstance(m, DiskMemory) for m in source.memories):
            raise OSError(5, "injected disk read error")
        return copy(self, source, destination, pairs)

    monkeypatch.setattr(Copier, "copy", failing)
    again = Request("again", document[: 10 * BLOCK] + [2])
    assert scheduler.get_num_new_matched_tokens(again, 0) == (0, False)  # a miss, no crash
    assert scheduler.counters.load_failures == 1 and "again" not in scheduler.loads
    scheduler.manager.check_invariants()
    monkeypatch.undo()
    # the pages are still on disk, whole: the next lookup loads them and they verify
    third = Request("third", document[: 10 * BLOCK] + [3])
    simulation.requests["third"] = third
    simulation.schedule(third)
    assert third.state == "loading" and third.num_computed_tokens == 10 * BLOCK
    before = simulation.verified_blocks
    simulation.step()
    assert simulation.verified_blocks == before + 10  # byte for byte what "first" computed
    simulation.scheduler.shutdown()
