"""The connector's scheduler and worker sides driven the way vLLM's scheduler drives them, by
random request streams: arrivals sharing prefixes (and repeating earlier prompts), lookups,
allocations, asynchronous loads, prefills and decode steps, finishes (saves), aborts while a
load is in flight, preemptions, and injected copy failures on the worker.

The simulated vLLM has KV-cache groups with vLLM's hybrid allocator's semantics: one block
pool (block 0 is the null block), a block table per group; a sliding-window group frees the
blocks wholly out of its window as the request computes (their entries become the null block)
and allocates a hit's blocks only from the window's start; a freed block is reused at once and
filled with garbage, as a reallocated block would be. Its KV tensors hold, in every block of
every layer, a function of the tokens before the block's end, the reuse scope, the group and
the layer, so a load that delivered wrong KV into any group is caught on the spot. kvpool's
first level is small and backed by a disk level, so pages are evicted and brought back.
"""

from __future__ import annotations

import random
import shutil
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs vLLM (scripts/test.sh runs this in its vLLM venv)")
torch = pytest.importorskip("torch")

from kvpool.integrations.vllm.scheduler import SchedulerSide  # noqa: E402
from kvpool.integrations.vllm.scoping import reuse_scope  # noqa: E402
from kvpool.integrations.vllm.settings import (  # noqa: E402
    ConnectorSettings,
    GroupFormat,
    PageFormat,
)
from kvpool.integrations.vllm.worker import WorkerSide, block_view  # noqa: E402
from kvpool.layout import KVLayout  # noqa: E402

BLOCK = 16
NUM_BLOCKS = 160  # vLLM's pool, all groups together (block 0: the null block)
NULL = 0
GARBAGE = -7.0  # what a reallocated block holds until it is computed


def layouts() -> dict[str, PageFormat]:
    """One full-attention group of two layers (vLLM without its hybrid allocator); and the
    hybrid allocator's groups of a Gemma-3-style model: one full-attention group, two
    sliding-window groups of one spec (which share a kvpool layer group), with a window that
    is a multiple of the block size and one that is not."""

    def group(names, window=None):
        return GroupFormat(tuple(names), 2, 64, 4, window)  # 8 KiB buffers

    hybrid = {
        f"hybrid-window-{w}": PageFormat(
            (group(["f0"]), group(["s0"], w), group(["s1"], w)), BLOCK, 0, 1
        )
        for w in (32, 40)
    }
    return {"full": PageFormat((group(["l0", "l1"]),), BLOCK, 0, 1), **hybrid}


LAYOUTS = layouts()


@dataclass
class Request:
    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None
    num_computed_tokens: int = 0
    lora_request: None = None
    mm_features: list[object] = field(default_factory=list)
    prompt_embeds: None = None
    num_prompt_tokens: int = 0
    tables: list[list[int]] = field(default_factory=list)  # per group; NULL: freed
    state: str = "waiting"  # waiting, loading, prefill, decode, saving
    outputs_left: int = 0
    hit: int = 0  # tokens the last load served
    repeat: bool = False  # its prompt repeats an earlier one's
    load_failed: bool = False  # (vLLM recomputes it: the connector must not offer it again)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.all_token_ids)


class Blocks:
    def __init__(self, tables: list[list[int]]) -> None:
        self.tables = tables

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple(list(ids) for ids in self.tables)


class Simulation:
    def __init__(
        self,
        seed: int,
        tmp_path,
        layout: str = "hybrid-window-32",
        fail_rate=0.1,
        node: str | None = None,
        documents_seed: int | None = None,
    ):
        """`node`: a node daemon's socket (its manager, not one of the connector's own);
        `documents_seed`: engines with the same one share their prompts' prefixes."""
        self.rng = random.Random(seed)
        self.page = page = LAYOUTS[layout]
        (tmp_path / "disk").mkdir(parents=True, exist_ok=True)
        host = (2 << 20) * (1 + page.windowed)  # (2 MiB a kvpool pool group: its granularity)
        settings = ConnectorSettings.parse(
            {"node_cache": f"unix://{node}", "node_timeout_ms": 2000}  # (a busy CI machine)
            if node
            else {"host_bytes": host, "disk_bytes": 2 * host, "disk_path": str(tmp_path / "disk")}
        )
        self.scheduler = SchedulerSide(settings, page, "fuzz-model")
        self.local = self.scheduler.manager is not None
        if self.local:
            self.scheduler.manager.record_decisions()
        config = page.manager_config(settings, "fuzz-model")
        self.worker = WorkerSide(page, NUM_BLOCKS, KVLayout(config.layers, BLOCK))
        shape = (NUM_BLOCKS, 2, 2, BLOCK, 64)
        self.kv = {n: torch.zeros(shape) for g in page.groups for n in g.layer_names}
        self.worker.register_kv_caches(self.kv)
        self.windows = [g.window for g in page.groups]
        self.free = list(range(1, NUM_BLOCKS))
        self.requests: dict[str, Request] = {}
        documents = random.Random(documents_seed) if documents_seed is not None else self.rng
        self.documents = [[documents.randrange(5000) for _ in range(BLOCK * 12)] for _ in range(4)]
        self.prompts: list[tuple[list[int], str | None]] = []  # earlier prompts, to repeat
        self.fail_rate = fail_rate
        self.next_id = 0
        self.failed_loads = 0
        self.injected_load_failures = 0
        self.not_yet = 0  # lookups answered "not yet" (their disk pages read ahead)
        self.failed_lookaheads = 0
        self.cancelled_lookups = 0  # requests aborted while their lookup waited
        self.verified_blocks = 0  # (group, block) pairs checked after a load
        self.stores = 0  # prompt-end stores handed to the workers
        self.repeat_hits = 0  # loads of a repeated prompt that served its whole blocks

    # -- the simulated vLLM ----------------------------------------------------------------
    def value(self, request: Request, group: int, layer: int, block: int) -> float:
        """What the model writes into a block: a function of the tokens up to the block's end,
        the scope, the group and the layer (a hit across any of them loads another value)."""
        prefix = tuple(request.all_token_ids[: (block + 1) * BLOCK])
        return float(hash((request.cache_salt, group, layer, prefix)) % 1_000_003)

    def skipped_blocks(self, group: int, num_computed: int) -> int:
        """vLLM's SlidingWindowManager: blocks wholly before the window of the next token."""
        window = self.windows[group]
        return 0 if window is None else max(0, num_computed - window + 1) // BLOCK

    def remove_skipped(self, request: Request, num_computed: int) -> None:
        for g, table in enumerate(request.tables):
            for i in range(min(self.skipped_blocks(g, num_computed), len(table))):
                if table[i] != NULL:
                    self.free.append(table[i])
                    table[i] = NULL

    def take(self, count: int) -> list[int] | None:
        if count > len(self.free):
            return None
        taken = [self.free.pop() for _ in range(count)]  # (the last freed first)
        for block in taken:
            for tensor in self.kv.values():
                tensor[block] = GARBAGE
        return taken

    def allocate(self, request: Request, num_tokens: int, num_computed: int) -> bool:
        """Blocks for `num_tokens` tokens of which `num_computed` are computed (a hit): a
        sliding window's blocks before its window are null blocks. All or nothing."""
        wanted = []
        for g, table in enumerate(request.tables or [[] for _ in self.windows]):
            first = self.skipped_blocks(g, num_computed)
            need = -(-num_tokens // BLOCK)
            wanted.append([i for i in range(len(table), need) if i >= first])
        blocks = self.take(sum(len(w) for w in wanted))
        if blocks is None:
            return False
        if not request.tables:
            request.tables = [[] for _ in self.windows]
        for g, table in enumerate(request.tables):
            need = -(-num_tokens // BLOCK)
            while len(table) < need:
                table.append(blocks.pop() if len(table) in wanted[g] else NULL)
        return True

    def release(self, request: Request) -> None:
        for table in request.tables:
            self.free += [b for b in table if b != NULL]
        request.tables = []

    def compute(self, request: Request, start: int, end: int) -> None:
        """The forward pass: positions [start, end) of every group's layers."""
        for g, group in enumerate(self.page.groups):
            for block in range(start // BLOCK, -(-end // BLOCK)):
                block_id = request.tables[g][block]
                assert block_id != NULL, "a computed position's block was freed"
                for layer, name in enumerate(group.layer_names):
                    self.kv[name][block_id] = self.value(request, g, layer, block)

    def verify(self, request: Request, end: int) -> None:
        """After a load of `end` tokens: every block vLLM holds for them, in every group."""
        for g, group in enumerate(self.page.groups):
            table = request.tables[g]
            held = [i for i in range(end // BLOCK) if table[i] != NULL]
            # (vLLM allocated a window's hit blocks only from the window's start)
            assert held == list(range(self.skipped_blocks(g, end), end // BLOCK))
            for block in held:
                for layer, name in enumerate(group.layer_names):
                    got = self.kv[name][table[block]]
                    expected = self.value(request, g, layer, block)
                    assert bool((got == expected).all()), (
                        f"wrong KV loaded for {request.request_id}: group {g}, block {block}"
                    )
                self.verified_blocks += 1

    def block_ids_for_computed(self, request: Request) -> tuple[list[int], ...]:
        """What vLLM hands `request_finished_all_groups`: out-of-window blocks freed first."""
        self.remove_skipped(request, request.num_computed_tokens)
        count = -(-request.num_computed_tokens // BLOCK)
        return tuple(list(table[:count]) for table in request.tables)

    def no_blocks(self) -> tuple[list[int], ...]:
        return tuple([] for _ in self.windows)

    # -- actions ---------------------------------------------------------------------------
    def arrive(self) -> None:
        if self.prompts and self.rng.random() < 0.2:
            tokens, salt = self.rng.choice(self.prompts)
            repeat = True
        else:
            document = self.rng.choice(self.documents)
            cut = self.rng.randrange(BLOCK, len(document))
            extra = [self.rng.randrange(5000) for _ in range(self.rng.randrange(20))]
            tokens, salt, repeat = document[:cut] + extra, self.rng.choice([None, None, "b"]), False
            self.prompts.append((tokens, salt))
        request = Request(f"r{self.next_id}", list(tokens), salt, repeat=repeat)
        request.outputs_left = self.rng.randrange(1, 6 * BLOCK)
        self.next_id += 1
        self.requests[request.request_id] = request

    def schedule(self, request: Request) -> None:
        """A waiting request: the connector's lookup, then its blocks (vLLM's allocate_slots).
        A lookup that needs disk I/O answers "not yet" (None) while the look-ahead threads
        read: the request stays waiting and is asked again on a later schedule (other
        operations in between: the answer is delayed), after its read-ahead is done (so the
        calls, and the decisions, are the same in every run); some read-aheads are made to
        fail (cancelled before they run: the lookup then reads synchronously, a miss never)."""
        lookups = self.scheduler.lookups  # (in process; a node daemon's are its own)
        waiting = self.scheduler._waiting
        if lookups is not None and request.request_id in lookups:
            lookahead = lookups._waiting[request.request_id]
            assert lookahead.wait(30)
        matched, is_async = self.scheduler.get_num_new_matched_tokens(request, 0)
        if matched is None:
            assert not is_async and request.request_id in waiting
            self.not_yet += 1
            if lookups is not None and self.rng.random() < 0.1:
                lookups._waiting[request.request_id].cancel()  # (a failed read-ahead)
                self.failed_lookaheads += 1
            return
        assert request.request_id not in waiting
        assert matched % BLOCK == 0
        assert matched < len(request.all_token_ids)
        assert is_async == (matched > 0)
        assert not (request.load_failed and matched), "a failed load offered again"
        if not self.allocate(request, len(request.all_token_ids), matched):
            return  # stays waiting: asked again later (its kvpool pages stay held)
        self.scheduler.update_state_after_alloc(request, Blocks(request.tables), matched)
        request.num_computed_tokens = matched
        request.hit = matched
        request.state = "loading" if matched else "prefill"

    def finish(self, request: Request) -> None:
        block_ids = self.block_ids_for_computed(request)
        delay, _ = self.scheduler.request_finished(request, block_ids)
        if delay:
            request.state = "saving"
        else:
            self.release(request)
            del self.requests[request.request_id]

    def step(self) -> None:
        """One engine step: scheduling (a window frees what left it; a decode may need a
        block), the connector's metadata, the worker's copies before the forward pass, the
        forward pass, the stores after it, and the outputs back to the scheduler side."""
        scheduled: dict[str, int] = {}
        for request in self.requests.values():
            if request.state not in ("prefill", "decode"):
                continue
            self.remove_skipped(request, request.num_computed_tokens)
            end = len(request.all_token_ids)
            if not self.allocate(request, end, request.num_computed_tokens):
                continue  # (no room this step: it waits)
            scheduled[request.request_id] = end - request.num_computed_tokens
        output = SimpleNamespace(
            num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values())
        )
        meta = self.scheduler.build_connector_meta(
            output, lambda rid: Blocks(self.requests[rid].tables).get_block_ids()
        )
        self.stores += len(meta.stores)
        failing = {
            t.request_id
            for t in meta.loads + meta.saves + meta.stores
            if self.rng.random() < self.fail_rate
        }
        self.injected_load_failures += sum(t.request_id in failing for t in meta.loads)
        original = self.worker._copy

        def copy(transfer, save):
            if transfer.request_id in failing:
                raise OSError("injected copy failure")
            original(transfer, save)

        self.worker._copy = copy  # (a plain Python class: the worker is not compiled)
        try:
            self.worker.start_load_kv(meta)
            for request_id, count in scheduled.items():
                request = self.requests[request_id]
                start = request.num_computed_tokens
                self.compute(request, start, start + count)
            self.worker.wait_for_save(meta)
        finally:
            self.worker._copy = original
        for request_id, count in scheduled.items():  # (each sampled one token)
            request = self.requests[request_id]
            request.num_computed_tokens += count
            request.all_token_ids.append(self.rng.randrange(5000))
            request.state = "decode"
            request.outputs_left -= 1
        sending, recving = self.worker.get_finished()
        errors = self.worker.take_load_errors()
        failed_recving = self.worker.take_failed_loads()
        assert not (errors and len(self.windows) > 1), "block ids are per group: no load errors"
        result = SimpleNamespace(
            finished_sending=sending,
            finished_recving=recving,
            kv_connector_worker_meta=self.worker.build_worker_meta(),
            invalid_block_ids=errors,
            failed_recving=failed_recving,
        )
        self.scheduler.update_connector_output(result)
        for request_id in recving or ():
            self.finish_load(self.requests[request_id], errors, failed_recving)
        for request_id in sending or ():
            request = self.requests.pop(request_id)
            self.release(request)

    def finish_load(self, request: Request, errors: set[int], failed: set[str]) -> None:
        failing = request.request_id in failed or errors & {b for t in request.tables for b in t}
        self.failed_loads += bool(failing)
        if request.state == "aborted while loading":
            self.release(request)
            del self.requests[request.request_id]
            return
        assert request.state == "loading"
        if failing:  # vLLM recomputes: from scratch, its blocks released
            request.load_failed = True
            self.release(request)
            request.state, request.num_computed_tokens = "waiting", 0
            return
        self.verify(request, request.hit)
        end = (request.num_prompt_tokens - 1) // BLOCK * BLOCK
        if request.repeat and request.hit == end:
            self.repeat_hits += 1
        # (vLLM schedules it again: a new allocation call, no external tokens)
        self.scheduler.update_state_after_alloc(request, Blocks(request.tables), 0)
        request.state = "prefill"

    def run(self, operations: int) -> None:
        for _ in range(operations):
            self.operation()

    def operation(self) -> None:
        """One of vLLM's calls, or one engine step, at random."""
        roll = self.rng.random()
        requests = list(self.requests.values())
        waiting = [r for r in requests if r.state == "waiting"]
        running = [r for r in requests if r.state in ("prefill", "decode")]
        decoded = [r for r in running if r.state == "decode" and r.outputs_left <= 0]
        loading = [r for r in requests if r.state == "loading"]
        if roll < 0.15 or not requests:
            self.arrive()
        elif roll < 0.3 and waiting:
            self.schedule(self.rng.choice(waiting))
        elif roll < 0.4 and decoded:
            self.finish(self.rng.choice(decoded))
        elif roll < 0.41 and running:  # finished early (a stop token)
            request = self.rng.choice([r for r in running if r.state == "decode"] or running)
            if request.state == "decode":
                self.finish(request)
        elif roll < 0.44 and loading:  # aborted while its load is in flight: vLLM keeps
            request = self.rng.choice(loading)  # its blocks until the load is reported
            delay, _ = self.scheduler.request_finished(
                request, Blocks(request.tables).get_block_ids()
            )
            assert not delay  # (nothing to save: its blocks may not hold their KV yet)
            request.state = "aborted while loading"
        elif roll < 0.47 and running:  # preempted: blocks freed, back to waiting
            request = self.rng.choice(running)
            self.release(request)
            request.state, request.num_computed_tokens = "waiting", 0
        elif roll < 0.5 and waiting:  # aborted before it ran (its lookup maybe waiting)
            looking = [r for r in waiting if r.request_id in self.scheduler._waiting]
            request = self.rng.choice(looking if looking and roll < 0.485 else waiting)
            if request.request_id in self.scheduler._waiting:
                self.cancelled_lookups += 1
            self.scheduler.request_finished(request, self.no_blocks())
            assert request.request_id not in self.scheduler._waiting
            self.release(request)
            del self.requests[request.request_id]
        else:  # (vLLM asks the lookups that said "not yet" again each step)
            for request in [r for r in waiting if r.request_id in self.scheduler._waiting]:
                self.schedule(request)
            self.step()
        if self.local:
            self.scheduler.manager.check_invariants()

    def drain(self) -> None:
        for _ in range(200):
            for request in list(self.requests.values()):
                if request.state == "decode":
                    self.finish(request)
                elif request.state in ("waiting", "prefill"):
                    self.scheduler.request_finished(request, self.no_blocks())
                    self.release(request)
                    del self.requests[request.request_id]
            self.step()
            if not self.requests:
                break
        assert not self.requests
        assert not self.scheduler._waiting  # (finished requests' lookups cancelled)
        assert not self.scheduler.loads and not self.scheduler.saves
        assert not self.scheduler.stores
        if self.local:
            assert len(self.scheduler.lookups) == 0
            assert self.scheduler.manager.num_open_kv_caches == 0
        assert sorted(self.free) == list(range(1, NUM_BLOCKS))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("seed", range(3))
def test_random_streams_never_load_wrong_kv_and_leave_nothing_behind(seed, layout, tmp_path):
    simulation = Simulation(seed, tmp_path, layout)
    simulation.run(1500)
    simulation.drain()
    counters = simulation.scheduler.counters
    # (the paths were reached: loads verified, evictions to disk, failed copies, saves)
    assert simulation.verified_blocks > 50
    assert simulation.failed_loads > 0 and counters.failed_saves > 0
    # (every load kvpool promised is delivered, unless a copy failure was injected)
    assert simulation.failed_loads == simulation.injected_load_failures
    assert counters.hit_tokens_by_tier["disk"] > 0
    assert counters.saved_blocks > 50
    # (asynchronous lookups: answered "not yet", some read-aheads failed, some cancelled)
    assert simulation.not_yet > 10 and simulation.failed_lookaheads > 0
    assert simulation.cancelled_lookups > 0
    if simulation.page.windowed:  # prompts' ends stored: a repeated prompt is served whole
        assert simulation.stores > 0 and simulation.repeat_hits > 0
    else:
        assert simulation.stores == 0 and counters.skipped_window_saves == 0
    # (what vLLM's metrics get: the copies' bytes and the failed loads' blocks)
    counts = simulation.worker.counts
    page = simulation.page
    smallest = min(2 * len(g.layer_names) * page.buffer_bytes(i) for i, g in enumerate(page.groups))
    assert counts["bytes_loaded"] >= simulation.verified_blocks * smallest
    assert counts["bytes_saved"] >= counters.saved_blocks * smallest
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
    group = GroupFormat(("l0",), 2, 64, 4)
    raw = torch.arange(3 * 2 * 32 * 128, dtype=torch.float32).view(3, 2, 32, 128)
    view = block_view(raw, 3, group, 32)
    assert view.shape == (3, 2, 2, 32, 64)
    # K of block 1, head 0, token 5 is the first half of row 5; V the same row of the second half
    keys, values = raw.view(3, 2, 64, 64)[1, 0, :32], raw.view(3, 2, 64, 64)[1, 0, 32:]
    assert torch.equal(view[1, 0, 0], keys) and torch.equal(view[1, 1, 0], values)
    view[2, 1, 1, 3] = -1.0  # a view: writes reach vLLM's tensor
    assert bool((raw.view(3, 2, 64, 64)[2, 1, 32 + 3] == -1.0).all())
    with pytest.raises(ValueError, match="does not know this KV-cache layout"):
        block_view(torch.zeros(3, 4, 32, 128), 3, group, 32)
    with pytest.raises(ValueError, match="blocks of 16 tokens"):
        block_view(raw, 3, group, 16)


def test_a_disk_read_error_at_lookup_is_a_miss_and_the_pages_survive(tmp_path, monkeypatch):
    from kvpool.storage.copier import Copier
    from kvpool.storage.memory import DiskMemory

    simulation = Simulation(3, tmp_path, fail_rate=0.0)
    scheduler = simulation.scheduler
    document = simulation.documents[0]

    def run_one(request_id: str, tokens: list[int]) -> Request:
        request = Request(request_id, tokens)
        simulation.requests[request_id] = request
        simulation.schedule(request)
        simulation.step()  # the prefill (its prompt's end stored)
        simulation.finish(request)
        simulation.step()  # saved, committed
        return request

    run_one("first", document[: 10 * BLOCK] + [1])
    for n in range(24):  # push its pages to disk: other prompts fill kvpool's first level
        run_one(f"other{n}", [50_000 + n * 1000 + i for i in range(10 * BLOCK)] + [1])
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
    assert scheduler.get_num_new_matched_tokens(again, 0) == (None, False)  # reading ahead
    assert scheduler.lookups._waiting["again"].wait(30)
    assert scheduler.get_num_new_matched_tokens(again, 0) == (0, False)  # a miss, no crash
    assert scheduler.counters.load_failures == 1 and "again" not in scheduler.loads
    scheduler.manager.check_invariants()
    monkeypatch.undo()
    # the pages are still on disk, whole: the next lookup loads them and they verify
    third = Request("third", document[: 10 * BLOCK] + [3])
    simulation.requests["third"] = third
    simulation.schedule(third)  # "not yet": its pages are read ahead from disk
    assert third.state == "waiting" and simulation.not_yet == 1
    simulation.schedule(third)
    assert third.state == "loading" and third.num_computed_tokens == 10 * BLOCK
    before = simulation.verified_blocks
    simulation.step()
    # byte for byte what "first" computed: 10 full-attention blocks, and each sliding group's
    # blocks in the window at the hit's end
    windows = sum(10 - simulation.skipped_blocks(g, 10 * BLOCK) for g in (1, 2))
    assert simulation.verified_blocks == before + 10 + windows
    simulation.scheduler.shutdown()


def decode_to(simulation: Simulation, request: Request, num_computed: int) -> None:
    """Schedule `request` (if new) and run steps until it has computed `num_computed`."""
    if request.request_id not in simulation.requests:
        simulation.requests[request.request_id] = request
        simulation.schedule(request)
    while request.state == "loading":
        simulation.step()
    while request.num_computed_tokens < num_computed:
        simulation.step()
    assert request.num_computed_tokens == num_computed


@pytest.mark.parametrize("length", [100, 96])
def test_a_prompts_window_is_stored_after_its_prefill_and_serves_the_prompt_again(tmp_path, length):
    """vLLM frees a sliding window's blocks as the request decodes: at its finish the window
    at the prompt's end is gone, so only the store after the prefill lets kvpool serve the
    same prompt again (its whole blocks but the last token's, every group verified)."""
    simulation = Simulation(5, tmp_path, fail_rate=0.0)
    prompt = simulation.documents[0][:length]
    end = (length - 1) // BLOCK * BLOCK  # 96, or 80 (a lookup leaves vLLM the last token)
    first = Request("first", list(prompt))
    decode_to(simulation, first, length)  # the prefill: its prompt's end is stored
    assert simulation.stores == 1
    decode_to(simulation, first, 150)
    assert first.tables[1][:5] == [NULL] * 5  # (the window's blocks up to the prompt's end)
    simulation.finish(first)
    simulation.step()
    saved = simulation.scheduler.counters.saved_blocks
    # the store: the full-attention blocks and 2 blocks of each window group; the save: the
    # rest of the full-attention blocks (up to 8) and each window's last two (7, 8)
    stored = end // BLOCK + 2 + 2
    assert saved == stored + (9 - end // BLOCK) + 2 + 2
    again = Request("again", list(prompt))
    decode_to(simulation, again, length)
    assert again.hit == end and simulation.repeat_hits == 0  # (not marked as a repeat)
    # and the conversation's next turn is served up to the first request's end
    turn = Request("turn", first.all_token_ids[:150] + [7] * 20)
    decode_to(simulation, turn, 170)
    assert turn.hit == 144
    simulation.scheduler.shutdown()


@pytest.mark.parametrize("num_computed", [191, 190])
def test_a_save_that_needs_a_window_block_vllm_freed_is_skipped(tmp_path, num_computed):
    """At its finish vLLM has freed every block wholly before the window of the token after
    the last computed one; kvpool's save ends at the last whole block, whose window may start
    one block earlier (191 computed tokens: 176 saved need blocks 9 and 10, vLLM holds 10 on):
    that save is skipped and counted, never filled from a freed block."""
    simulation = Simulation(5, tmp_path, fail_rate=0.0)
    request = Request("r", simulation.documents[1][:40])
    decode_to(simulation, request, num_computed)
    block_ids = simulation.block_ids_for_computed(request)
    assert block_ids[1][9] == (NULL if num_computed == 191 else request.tables[1][9])
    delay, _ = simulation.scheduler.request_finished(request, block_ids)
    counters = simulation.scheduler.counters
    if num_computed == 191:
        assert not delay and counters.skipped_window_saves == 1
    else:
        assert delay and counters.skipped_window_saves == 0
    simulation.scheduler.shutdown()


@pytest.mark.parametrize("fails", [False, True])
def test_a_store_is_committed_once_every_worker_copied_it(tmp_path, fails):
    """Stores run in each worker after the forward pass; vLLM merges the workers' reports
    (summed), so the scheduler side commits once all of them copied, and nothing if one
    failed."""
    from kvpool.integrations.vllm.worker import KVPoolWorkerMetadata

    simulation = Simulation(5, tmp_path, fail_rate=0.0)
    scheduler = simulation.scheduler
    scheduler.num_workers = 2
    prompt = simulation.documents[0][:100]
    decode_to(simulation, Request("r", list(prompt)), 100)  # (this worker's report: 1 of 2)
    assert "r" in scheduler.stores and scheduler.manager.probe_reuse(None, prompt[:96]) == 0
    other = KVPoolWorkerMetadata(stored={"r": 1}, failed_stores={"r"} if fails else set())
    output = SimpleNamespace(
        finished_sending=None, finished_recving=None, kv_connector_worker_meta=other
    )
    scheduler.update_connector_output(output)
    assert "r" not in scheduler.stores
    assert scheduler.manager.probe_reuse(None, prompt[:96]) == (0 if fails else 96)
    assert scheduler.counters.failed_saves == int(fails)
    simulation.scheduler.shutdown()


@pytest.mark.parametrize("seed", range(3))
def test_a_worker_that_dies_mid_copy_commits_nothing_and_the_engine_stops_clean(seed, tmp_path):
    """A worker killed in the middle of a step's copies: vLLM's engine stops (its executor
    sees the worker die) and the scheduler side is shut down with the step's saves and stores
    never reported: none of their blocks is committed (no later lookup, in this process or
    from a persistent disk level, can find a page whose bytes were never all written), every
    kvpool request is closed, the manager releases everything."""
    simulation = Simulation(100 + seed, tmp_path)
    simulation.run(300)
    side, worker = simulation.scheduler, simulation.worker
    start = worker.start_load_kv
    dead: list = []

    def start_and_die(meta):
        if not meta.saves:
            return start(meta)
        dead.append(meta)
        half = meta.saves[: len(meta.saves) // 2]  # (copies done before the kill)
        start(type(meta)(meta.shared, saves=half))
        raise SystemExit("the worker is killed here")  # (mid-step: nothing is reported)

    worker.start_load_kv = start_and_die
    with pytest.raises(SystemExit):
        simulation.run(2000)
    meta = dead[0]
    in_flight = {t.request_id: side.saves[t.request_id] for t in meta.saves}
    for request_id, pending in in_flight.items():
        scope = reuse_scope(simulation.requests[request_id], side.adapters)
        tokens = list(simulation.requests[request_id].all_token_ids[: pending.num_tokens])
        committed = side.manager.probe_reuse(scope, tokens, remote=False)
        assert committed < pending.num_tokens, "a save never reported was committed"
    side.shutdown()  # (vLLM stops the engine: no report ever comes)
    assert side.manager._closed


def test_several_engines_over_one_daemon_with_deaths_and_restarts(tmp_path):
    """Three engines' connectors (same prompts' prefixes) over one node daemon, interleaved at
    random: an engine dies (its connection dropped, its state gone) and a new one joins; the
    daemon is SIGKILLed mid-stream and restarted; the engines reconnect by themselves. Every
    load is checked block by block (a load of another engine's save included); at the end the
    daemon holds nothing."""
    from kvpool.node.client import daemon_statistics
    from tests.node_helpers import Daemon, socket_dir

    directory = socket_dir()
    disk = tmp_path / "node-disk"
    disk.mkdir()
    flags = ["--host-bytes", "4MiB", "--disk-bytes", "8MiB", "--disk-path", str(disk)]
    daemon = Daemon(f"{directory}/kvpool.sock", *flags, "--release-grace-ms", "100").start()
    rng = random.Random(11)

    def engine(n: int) -> Simulation:
        return Simulation(n, tmp_path / f"e{n}", node=daemon.socket, documents_seed=5)

    engines = [engine(n) for n in range(3)]
    gone: list[Simulation] = []
    try:
        for operation in range(2400):
            rng.choice(engines).operation()
            if operation == 800:  # an engine dies: the daemon notices its connection close
                dead = engines.pop(0)
                dead.scheduler.store._close_connection()
                gone.append(dead)
                engines.append(engine(3))
            if operation == 1200:  # an engine's call times out with loads planned: it
                lost = engines[0]  # drops the connection, the daemon releases their pages
                for request in list(lost.requests.values()):
                    if request.state == "waiting":
                        lost.schedule(request)
                lost.scheduler.store._down("a call timed out (injected)")
                time.sleep(0.3)  # (past the grace: other engines may take those pages now)
                for _ in range(100):
                    rng.choice(engines[1:]).operation()
                lost.step()  # (its planned copies, before any call of its own reconnects)
            if operation == 1600:  # the daemon dies, and a new one starts (empty)
                before = [e.scheduler.store.generation for e in engines]
                for simulation in engines:  # loads and saves planned, not yet copied
                    for request in list(simulation.requests.values()):
                        if request.state == "waiting":
                            simulation.schedule(request)
                        elif request.state == "decode" and request.outputs_left <= 0:
                            simulation.finish(request)
                daemon.kill()
                daemon.start()
                # each engine notices (a call fails) and reconnects before its next step:
                # what it planned in the old daemon's memory meets the new daemon's memory
                for simulation in engines:
                    waiting = [r for r in simulation.requests.values() if r.state == "waiting"]
                    if waiting:
                        simulation.schedule(waiting[0])
                    store = simulation.scheduler.store
                    store.statistics()
                    deadline = time.monotonic() + 10
                    while not store.connected:
                        store.statistics()
                        assert time.monotonic() < deadline
                        time.sleep(0.01)
        for simulation in engines:
            simulation.drain()
        node = daemon_statistics(daemon.socket)
        # (each lost its connection and made a new one: two generations more)
        assert [e.scheduler.store.generation for e in engines] == [g + 2 for g in before]
        for simulation in engines:
            simulation.scheduler.shutdown()
        deadline = time.monotonic() + 5
        while daemon_statistics(daemon.socket)["open_requests"] and time.monotonic() < deadline:
            time.sleep(0.05)
        after = daemon_statistics(daemon.socket)
    finally:
        daemon.stop()
        shutil.rmtree(directory, ignore_errors=True)
    every = engines + gone
    verified = sum(s.verified_blocks for s in every)
    hits = sum(s.scheduler.counters.hit_tokens for s in every)
    assert verified > 100 and hits > 0
    # (every load promised was delivered unless a copy failure was injected, or its plan was
    # made in the killed daemon's memory: those fail on the worker, and vLLM recomputes)
    assert sum(s.failed_loads for s in every) >= sum(s.injected_load_failures for s in every)
    # the engine that joined late was served what the others saved (all checked)
    assert engines[-1].scheduler.counters.hit_tokens > 0 and engines[-1].verified_blocks > 0
    assert node["engines"] == 3 and after["open_requests"] == 0 and after["engines"] == 0
    # (copies planned in the killed daemon's memory, handed to the workers after the restart:
    # failed, never copied from the new daemon's memory)
    assert sum(s.scheduler.counters.stale_transfers for s in engines) > 0
