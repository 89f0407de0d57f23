"""What the processes spawned by tests/test_distributed.py run (gloo on CPU): tensor-parallel
generation with agreed rebalancing, a planted divergence, and the two agreement modes. Each
scenario saves what it saw to `{folder}/{scenario}-{rank}.pt` for the parent to compare."""

from __future__ import annotations

import datetime
import itertools
import random
from typing import Any

import torch
import torch.distributed as dist

from kvpool import (
    DiskCacheTierConfig,
    DivergenceError,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
)
from kvpool.distributed import Agreement
from tests.helpers import MiB, kv_layer, make_config

TPB = 8


def launch(rank: int, world: int, port: int, scenario: str, folder: str, *args: Any) -> None:
    """The entry point of a spawned process."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        result = SCENARIOS[scenario](rank, folder, *args)
        torch.save(result, f"{folder}/{scenario}-{rank}.pt")
    finally:
        dist.destroy_process_group()


def skewed_clock(group_rank: int):
    """Rank 0's clock runs (ten seconds per reading); every other rank's is stuck: on its own,
    only rank 0 would ever pass the rebalancing cooldown."""
    if group_rank == 0:
        ticks = itertools.count(step=10)
        return lambda: float(next(ticks))
    return lambda: 0.0


def generate(rank: int, folder: str, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each job: tensor-parallel generation over `groups` (lists of ranks; each group is a
    "node" running its own replica, with its own prompts) through host and disk, with agreed
    rebalancing and the divergence check on."""
    from kvpool.engine import Generator, PagedDecoder, manager_config_from_hf
    from kvpool.engine.parallel import TensorParallel

    outcomes = []
    for number, job in enumerate(jobs):
        groups = [dist.new_group(ranks) for ranks in job["groups"]]  # every rank creates each
        node = next(i for i, ranks in enumerate(job["groups"]) if rank in ranks)
        group = groups[node]
        tp = TensorParallel.of(group)
        tiers = [
            HostCacheTierConfig(job["host"]),
            DiskCacheTierConfig(job["disk"], f"{folder}"),
        ]
        config = job["config"]
        manager_config = manager_config_from_hf(
            config, TPB, job["gpu"], tiers, tensor_parallel_size=tp.size, **job["options"]
        )
        manager = KVCacheManager(manager_config, clock=skewed_clock(tp.rank))
        agreement = Agreement(manager, group, check=True)
        adjusted_at: list[int] = []
        adjust = agreement.adjust

        def recorded_adjust(adjust=adjust, agreement=agreement, adjusted_at=adjusted_at) -> None:
            adjusted_at.append(agreement.step)
            adjust()

        agreement.adjust = recorded_adjust  # type: ignore[method-assign]
        local_need: list[bool] = []
        decoder = PagedDecoder(config, job["state_dict"], manager, tensor_parallel=tp)
        generator = Generator(
            decoder,
            max_batch=job["max_batch"],
            agreement=agreement,
            between_steps=lambda step, m=manager, seen=local_need: seen.append(m.need_adjustment),
        )
        rounds = []
        for prompts, new_tokens in job["rounds"][node]:
            results = generator.generate(prompts, new_tokens)
            rounds.append(
                [(r.prompt, r.tokens, torch.stack(r.logits), r.cached_tokens) for r in results]
            )
        outcomes.append(
            {
                "job": number,
                "node": node,
                "tp_rank": tp.rank,
                "rounds": rounds,
                "adjusted_at": adjusted_at,
                "local_need": local_need,
                "steps": agreement.step,
                "suspensions": generator.suspensions,
                "moved": manager.num_moved_pages,
                "slot_counts": [manager.get_slot_counts(level) for level in range(3)],
                "slot_bytes": manager.layout.placement(0, "k").size,
            }
        )
        manager.clear_reusable_blocks()
        manager.shutdown()
    return outcomes


def diverge(rank: int, folder: str) -> dict[str, Any]:
    """The same requests on both ranks, but from request 6 on rank 1 gives its blocks a lower
    eviction priority: its first eviction drops request 6's pages, rank 0's request 0's."""
    manager = KVCacheManager(
        make_config(
            layers=[kv_layer(0, size=16 * 1024)],
            tokens_per_block=16,
            tiers=[GpuCacheTierConfig(2 * MiB)],
        )
    )
    agreement = Agreement(manager, check=True)
    total = manager.get_storage_statistics(0)[0].total
    message, ended = None, []
    try:
        for request in range(total):
            priority = 0 if rank == 1 and request >= 6 else 10
            cache = manager.create_kv_cache(priority_callback=lambda ordinal, group, p=priority: p)
            assert cache.resume() and cache.resize(16 * 12)
            cache.commit([request * 1000 + t for t in range(16 * 12)])
            cache.close()
            agreement.end_step()
            ended.append(request)
    except DivergenceError as error:
        message = str(error)
    # Request 6 is the first with other priorities on rank 1; the first eviction after it
    # (the first request past 6 whose 12 blocks do not fit) drops different pages there.
    diverges_at = min(r for r in range(7, total) if (r + 1) * 12 > total)
    manager.clear_reusable_blocks()
    manager.shutdown()
    return {"message": message, "ended": ended, "diverges_at": diverges_at}


def agreement_modes(rank: int, folder: str) -> dict[str, Any]:
    """Broadcast mode with skewed clocks (only rank 0's cooldown passes) and any mode where only
    rank 1's estimator has samples: the agreed answer is the same on both ranks."""
    layers = [kv_layer(0, size=4096), kv_layer(1, size=16384, window=32)]  # two pool groups
    options = dict(
        rebalance_min_sampled_kv_caches=4,
        rebalance_cooldown_secs=5.0,
        rebalance_target_ratio_update_interval=1,
        rebalance_moving_average_decay=0.5,
        initial_pool_ratio=[0.5, 0.5],
    )
    seen = {}
    for mode in ("broadcast", "any"):
        manager = KVCacheManager(
            make_config(
                layers=layers, tokens_per_block=16, tiers=[GpuCacheTierConfig(8 * MiB)], **options
            ),
            clock=skewed_clock(rank if mode == "broadcast" else 0),
        )
        agreement = Agreement(manager, mode=mode, check=True)
        feeds = mode == "broadcast" or rank == 1  # in any mode only rank 1 sees requests
        for request in range(8):
            if feeds:
                cache = manager.create_kv_cache()
                assert cache.resume() and cache.resize(16 * 40)
                cache.commit([request * 1000 + t for t in range(16 * 40)])
                cache.close()
            if mode == "broadcast":
                agreement.end_step()
        before = manager.get_slot_counts(0)
        local = manager.need_adjustment
        agreed = agreement.need_adjustment()
        if agreed:
            agreement.adjust()
        if mode == "broadcast":
            agreement.end_step()  # the check covers the re-split too
        seen[mode] = {
            "local": local,
            "agreed": agreed,
            "before": before,
            "after": manager.get_slot_counts(0),
        }
        manager.clear_reusable_blocks()
        manager.shutdown()
    return seen


def policy_agreement(rank: int, folder: str, requests: int) -> dict[str, Any]:
    """The same requests on every rank with the default (hazard) eviction policy, each rank's
    manager on its own process clock (the default `time.monotonic`), a GPU and a host level,
    long enough for the policy to learn (many capacities of blocks come in) and then pick
    victims other than LRU's. The check compares every step's decisions."""
    manager = KVCacheManager(
        make_config(
            layers=[kv_layer(0, size=16 * 1024)],
            tokens_per_block=8,
            tiers=[GpuCacheTierConfig(2 * MiB), HostCacheTierConfig(2 * MiB)],
        )
    )
    assert manager.config.eviction_policy == "hazard"  # (the default)
    agreement = Agreement(manager, check=True)
    rng = random.Random(0)
    documents = [
        [rng.randrange(1000) for _ in range(rng.choice([16, 24, 40, 64]))] for _ in range(60)
    ]
    weights = [1 / (i + 1) for i in range(60)]
    message, hits = None, 0
    try:
        for _ in range(requests):
            prompt = rng.choices(documents, weights)[0] + [
                rng.randrange(1000) for _ in range(rng.randrange(1, 20))
            ]
            cache = manager.create_kv_cache(None, prompt)
            hits += cache.num_committed_tokens
            if cache.resume() and cache.resize(len(prompt)):
                cache.commit(prompt[cache.num_committed_tokens :])
            cache.close()
            agreement.end_step()
    except DivergenceError as error:
        message = str(error)
    policy = manager._policy
    queue = manager._storage.state.queues[manager._storage.state.last_level][0]
    outcome = {
        "message": message,
        "steps": agreement.step,
        "hits": hits,
        "learned": getattr(policy, "width", 0) > 0,
        "classed": getattr(queue, "_classed", 0),
        "capacity": getattr(policy, "capacity", 0),
        "inflow": getattr(policy, "now", 0),
        "dropped": manager._storage.state.num_dropped,
        "moved": manager.num_moved_pages,
    }
    manager.clear_reusable_blocks()
    manager.shutdown()
    return outcome


SCENARIOS = {
    "generate": generate,
    "diverge": diverge,
    "agreement_modes": agreement_modes,
    "policy_agreement": policy_agreement,
}
