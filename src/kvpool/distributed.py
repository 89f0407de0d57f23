"""Replicated KV-cache managers that agree, over a torch.distributed process group.

Under tensor parallelism every rank runs its own manager over its share of the KV heads, and the
scheduler's decisions (prefix hits, `resume()`/`resize()` outcomes, evictions, suspensions,
rebalancing) must be the same on every rank, or the ranks' forward passes stop matching. Given
the same calls, kvpool's managers take the same decisions: the slot allocator hands out ids in
call order whatever the copy timing, iteration is over insertion-ordered dicts and lists (never
over sets of objects), nothing is random or seeded per process. The one input that differs is
the clock of the rebalancing cooldown; `Agreement` takes that decision once for all ranks:

    agreement = Agreement(manager)             # after torch.distributed.init_process_group
    for step in engine_loop:
        if agreement.need_adjustment():        # one small collective
            agreement.adjust()                 # the same targets on every rank
        ...schedule: create, resume, resize, suspend, close...
        agreement.end_step()                   # with check=True: one 8-byte all-gather
        ...forward passes...

`mode="broadcast"` (tensor parallelism) takes rank `src`'s decision and its estimator's targets;
`mode="any"` (attention data parallelism, where ranks serve different requests) adjusts on every
rank when any rank's estimator wants it, each toward its own targets. `check=True` compares a
digest of each step's decisions across ranks and raises `DivergenceError` naming the first one
that differs (debugging; it records drops and moves by slot id).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from kvpool.errors import ArgumentError, ConfigError, DivergenceError
from kvpool.manager import KVCacheManager
from kvpool.validation import check_bool, check_int, fail

MODES = ("broadcast", "any")


class Agreement:
    """Keeps one rank's KV-cache manager in step with the other ranks of `group`."""

    def __init__(
        self,
        manager: KVCacheManager,
        group: Any = None,
        *,
        mode: str = "broadcast",
        src: int = 0,
        check: bool = False,
        interval: int = 1,
    ) -> None:
        """`group`: a torch.distributed process group (None: the default one). `src`: the rank
        in `group` whose decision `mode="broadcast"` takes. `interval`: agree on every
        `interval`-th call of `need_adjustment()` only, answering no in between without
        communicating (the cooldown is minutes; a collective costs a few hundred microseconds)."""
        if not dist.is_available() or not dist.is_initialized():
            raise ArgumentError(
                "Agreement needs torch.distributed initialized "
                "(torch.distributed.init_process_group, or a launch by torchrun)"
            )
        if mode not in MODES:
            fail("mode", mode, f"one of {list(MODES)}")
        check_bool("check", check)
        self.manager = manager
        self.group = group
        self.mode = mode
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.src = check_int("src", src, 0, self.size - 1)
        self.interval = check_int("interval", interval, 1)
        remote = manager._config.remote_tier
        if mode == "broadcast" and remote is not None and remote.shard != self.rank:
            raise ConfigError(
                f"remote_tier.shard={remote.shard} is invalid: under tensor parallelism it must "
                f"be the rank ({self.rank}): ranks hold different KV heads in same-sized pages"
            )
        self._calls = 0
        self._src_global = src if group is None else dist.get_global_rank(group, src)
        self.check = check
        self.step = 0  # steps ended so far
        self.num_adjustments = 0
        nccl = dist.get_backend(group) == "nccl"
        self._device = torch.device("cuda", torch.cuda.current_device()) if nccl else None
        self._targets: tuple[list[float] | None, list[float] | None] | None = None
        if check:
            manager.record_decisions(True)

    # -- rebalancing -----------------------------------------------------------------------------

    def need_adjustment(self) -> bool:
        """`manager.need_adjustment`, agreed: the same answer on every rank (one collective, on
        every `interval`-th call)."""
        self._calls += 1
        if self._calls % self.interval:
            need = False
        elif self.mode == "any":
            flag = self._tensor([1.0 if self.manager.need_adjustment else 0.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            need = bool(flag[0] > 0)
        else:
            need = self._broadcast_decision()
        self.manager.note_decision("need_adjustment", need)
        return need

    def _broadcast_decision(self) -> bool:
        """Rank `src`'s decision and, when it is yes, its estimator's targets (float64 so that
        every rank computes the same slot counts from them)."""
        groups = self.manager.num_pool_groups
        message = [0.0] * (3 + 2 * groups)  # need, has gpu target, has cold target, targets
        if self.rank == self.src and self.manager.need_adjustment:
            estimator = self.manager.rebalancer
            message[0] = 1.0
            for i, target in enumerate((estimator.gpu_target, estimator.cold_target)):
                if target is not None:
                    message[1 + i] = 1.0
                    message[3 + i * groups : 3 + (i + 1) * groups] = target
        buffer = self._tensor(message)
        dist.broadcast(buffer, self._src_global, group=self.group)
        values = buffer.tolist()
        if not values[0]:
            return False
        gpu = values[3 : 3 + groups] if values[1] else None
        cold = values[3 + groups :] if values[2] else None
        self._targets = (gpu, cold)
        return True

    def adjust(self) -> None:
        """`manager.adjust()` toward the agreed targets (rank `src`'s, in broadcast mode; each
        rank's own, in any mode). Call it on every rank right after `need_adjustment()` said
        yes; it needs no collective."""
        if self._targets is not None:
            estimator = self.manager.rebalancer
            estimator.gpu_target, estimator.cold_target = self._targets
            self._targets = None
        self.manager.adjust()
        self.num_adjustments += 1

    # -- divergence check ------------------------------------------------------------------------

    def end_step(self) -> None:
        """Close a scheduling step. With `check`, all-gather an 8-byte digest of the step's
        decisions and the managers' state, and raise `DivergenceError` on every rank if they
        differ (naming the first decision that does, and the ranks)."""
        self.step += 1
        if not self.check:
            return
        entries = [*self.manager.take_decisions(), *decision_state(self.manager)]
        digest = hashlib.sha256(repr(entries).encode()).digest()[:8]
        mine = self._tensor([int.from_bytes(digest, "little", signed=True)], torch.int64)
        digests = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(digests, mine, group=self.group)
        if all(bool((d == digests[0]).all()) for d in digests):
            return
        logs: list[Any] = [None] * self.size
        dist.all_gather_object(logs, entries, group=self.group)
        raise DivergenceError(describe_divergence(self.step, logs))

    def _tensor(self, values: list[Any], dtype: torch.dtype = torch.float64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self._device)


def decision_state(manager: KVCacheManager) -> list[tuple[object, ...]]:
    """What a step's decisions left behind: each open request's status and sizes, each level's
    split and free/evictable slots, the pages dropped so far."""
    rows: list[tuple[object, ...]] = [
        (
            "request",
            cache.id,
            cache.status.name,
            cache.capacity,
            cache.history_length,
            cache.num_committed_tokens,
        )
        for cache in manager.open_kv_caches
    ]
    for level in range(manager.num_levels):
        stats = manager.get_storage_statistics(level)
        rows.append(
            (
                "level",
                level,
                tuple(manager.get_slot_counts(level)),
                tuple((s.free, s.evictable) for s in stats),
            )
        )
    rows.append(("dropped pages", manager.num_dropped_pages))
    return rows


def describe_divergence(step: int, logs: list[list[tuple[object, ...]]]) -> str:
    """The first decision on which some rank differs from rank 0."""
    for index in range(max(map(len, logs))):
        values = [log[index] if index < len(log) else "(no such decision)" for log in logs]
        differing = [rank for rank, value in enumerate(values) if value != values[0]]
        if differing:
            rank = differing[0]
            return (
                f"step {step}: ranks disagree from decision {index} on: rank 0 {values[0]!r}, "
                f"rank {rank} {values[rank]!r} (ranks differing from rank 0: {differing})"
            )
    return f"step {step}: the digests differ but the decisions compare equal"  # pragma: no cover


__all__ = ["MODES", "Agreement", "decision_state", "describe_divergence"]
