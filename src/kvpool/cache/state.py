"""A request's state: lengths, pages and page tables, what the parts of its cache read and change.

Lengths: ``num_committed_tokens <= history_length <= capacity``. `capacity` tokens have blocks
(``ceil(capacity / tokens_per_block)``); the KV of the first `history_length` tokens is computed;
committed tokens are final and their full blocks are in the radix tree.

Every page in the request's tables is owned by it: locked while ACTIVE, held while SUSPENDED.
Per step the work is proportional to the blocks that change, never to the history.

`KVCache` is this state plus its life cycle; the parts that change it step by step (`Growth`:
resize and sliding windows, `Commits`: commit and radix-tree insertion, `Forking`, and
`RemoteLoading`) are objects made once per manager that are called with the request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Final, SupportsIndex

import numpy as np
import numpy.typing as npt

from kvpool import _debug
from kvpool.errors import LogicError
from kvpool.layout import KVLayout
from kvpool.page_table import PageTable
from kvpool.policies import EvictionPolicy
from kvpool.radix import RadixTree
from kvpool.records import Page
from kvpool.remote import RemotePrefix, RemoteTier
from kvpool.stats import Counters
from kvpool.tiers import Allocation, Migration, Ownership, StorageState
from kvpool.tokens import Token
from kvpool.validation import check_index

GPU_LEVEL: Final = 0
PriorityCallback = Callable[[int, int], int]
"""(block ordinal, layer group id) -> eviction priority in [0, 100]; lower is evicted first.
Called for every layer group of every block a commit fills (or the tail `stop_committing`
inserts), before the commit changes anything: if it raises or returns a bad value, the commit
raises with nothing changed."""
Priorities = dict[tuple[int, int], int]


class KVCacheStatus(Enum):
    ACTIVE = "active"
    SUSPENDED = "suspended"
    CLOSED = "closed"


ACTIVE: Final = KVCacheStatus.ACTIVE  # (a module constant: read on every step)


@dataclass
class CacheContext:
    """What a request needs from its manager (so the cache does not depend on the manager):
    of the storage, the parts it calls (its page counts, owner counts, new pages, copies)."""

    layout: KVLayout
    state: StorageState
    owners: Ownership
    allocation: Allocation
    migration: Migration
    tree: RadixTree
    max_util_for_resume: float
    on_close: Callable[[RequestState], None]
    check: Callable[[], None]
    check_thread: Callable[[], None]
    remote: RemoteTier | None = None
    counters: Counters = field(default_factory=Counters)
    policy: EvictionPolicy | None = None  # (None: LRU, the queue's own order)


class RequestState:
    """One request's state (see the module docstring); the parts of its cache are given it."""

    def __init__(
        self,
        context: CacheContext,
        cache_id: int,
        scope_key: bytes,
        priority_callback: PriorityCallback | None,
        exclude_from_stats: bool = False,
    ) -> None:
        self._ctx = context
        self.id = cache_id
        self.exclude_from_stats = exclude_from_stats
        """Warm-up or padding requests: their shapes never feed the rebalancing estimate."""
        self.reused_length = 0  # tokens reused at creation
        self._sum_capacity = self._sum_history = self._num_resizes = 0  # for `mean_shape`
        self._priority_callback = priority_callback
        # `KVPOOL_DEBUG`'s checks, read once here: a field per call, not a module lookup
        self._checks = _debug.DEBUG
        self._status = KVCacheStatus.SUSPENDED
        layout = context.layout
        self._tpb = layout.tokens_per_block
        self._capacity = self._history = self._committed = 0
        self._committing = True
        self._scope_key = scope_key
        # Key of the last committed full block: the next block goes under the tree's block with
        # this key (or the scope's root), looked up when it is committed, so no block object is
        # kept between calls.
        self._prev_key = scope_key
        self._tail: list[Token] = []  # committed tokens of the unfinished block
        self._attention = layout.attention
        self._attention_groups = [g for g, _ in layout.attention_pools]
        self._windowed = layout.windowed
        self._ssm = layout.ssm_groups
        self._table = PageTable(len(layout.life_cycles), self._ssm)
        self._pages = self._table.pages  # per layer group: the page of each block (or SSM state)
        self._released_end = [0] * len(self._pages)  # stale blocks below this are released
        self._window_check = 0  # below this history length no window lets a block go
        # Shared pages to copy into private ones on first resume: (layer group, block, page).
        # The block is -1 for an SSM state snapshot.
        self._deferred: list[tuple[int, int, Page]] = []
        # The part of the reused prefix the remote tier holds, fetched by the first resume()
        # or prefetch(); its tokens count as committed until then. (Keep the attributes of a
        # request under 30: past that CPython stops sharing instance-dict keys, and every
        # attribute access of the hot loop gets slower: +9% per decode step.)
        self._remote: RemotePrefix | None = None

    # -- state -----------------------------------------------------------------------------------

    @property
    def status(self) -> KVCacheStatus:
        return self._status

    @property
    def capacity(self) -> int:
        remote = self._remote
        return self._capacity if remote is None else self._capacity + remote.num_tokens

    @property
    def history_length(self) -> int:
        remote = self._remote
        return self._history if remote is None else self._history + remote.num_tokens

    @property
    def num_committed_tokens(self) -> int:
        """Committed tokens. With a remote tier, a new request's count includes the prefix
        found there, final only after the first `resume()`/`prefetch()`: a remote block that
        vanished or failed its check shortens it (re-read it then)."""
        remote = self._remote
        return self._committed if remote is None else self._committed + remote.num_tokens

    @property
    def pending_remote_tokens(self) -> int:
        """Tokens of the reused prefix found in the remote tier and not fetched yet (counted in
        `num_committed_tokens`; 0 after the first `resume()`/`prefetch()`)."""
        return 0 if self._remote is None else self._remote.num_tokens

    @property
    def num_blocks(self) -> int:
        return -(-self._capacity // self._tpb)

    @property
    def mean_shape(self) -> tuple[float, float]:
        """Mean capacity and history length over the calls to `resize` (0, 0 if none)."""
        count = self._num_resizes
        return (self._sum_capacity / count, self._sum_history / count) if count else (0.0, 0.0)

    def refresh_tables(self) -> None:
        """Rewrite the page tables from the pages (their slots change when pages move)."""
        self._table.refresh()

    def get_base_page_indices(self, layer_group_id: SupportsIndex) -> npt.NDArray[np.int32]:
        """Slot id of each block's page in `layer_group_id` (-1 where the block has none), as a
        read-only int32 view; for an SSM layer group one entry, the live state's slot."""
        self._require_open("get_base_page_indices")
        group = check_index("layer_group_id", layer_group_id, len(self._pages))
        return self._table.base_indices(group)

    def get_page_indices(self, layer_id: SupportsIndex, role: object) -> npt.NDArray[np.int32]:
        """Rows of `manager.page_view(layer_id, role)` for each block (-1 where none)."""
        self._require_open("get_page_indices")
        return self._table.page_indices(self._ctx.layout.placement(layer_id, role))

    def pages(self, layer_group_id: SupportsIndex) -> list[Page | None]:
        """The request's pages of one layer group (for introspection and tests)."""
        return list(self._pages[layer_group_id])

    def _new_page(self, g: int) -> Page:
        (page,) = self._new_pages(g, 1)
        return page

    def _new_pages(self, g: int, count: int) -> list[Page]:
        """`count` new pages of layer group `g` on the GPU, locked by this request."""
        if count <= 0:
            return []
        return self._ctx.allocation.new_pages(
            GPU_LEVEL, self._ctx.layout.pool_group_of[g], g, count, locks=1
        )

    def _set_page(self, g: int, index: int, page: Page) -> None:
        """Put a page this request already owns into its table."""
        self._table.set(g, index, page)

    def _require_open(self, operation: str) -> None:
        if self._status is KVCacheStatus.CLOSED:
            raise LogicError(f"{operation}() on KV cache {self.id}, which is closed")
        if self._checks:
            self._ctx.check_thread()

    def _require_active(self, operation: str) -> None:
        if self._status is not KVCacheStatus.ACTIVE:
            raise LogicError(
                f"{operation}() on KV cache {self.id}, which is {self._status.value} (it must be active)"
            )

    def _after_call(self) -> None:
        if self._checks:
            self._ctx.check()

    def __repr__(self) -> str:
        return (
            f"KVCache(id {self.id}, {self._status.value}, capacity {self._capacity}, history "
            f"{self._history}, committed {self._committed})"
        )
