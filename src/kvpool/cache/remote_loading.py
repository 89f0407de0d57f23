"""Loading the remote part of a request's reused prefix into local pages (first `resume()` or
`prefetch()` of a request that `create_kv_cache` found past its local prefix in the remote tier).

The pages are fetched and checked (`RemoteTier.fetch`), written into new slots at the target
level (or a colder one with room), and their blocks inserted into the radix tree, so other
requests reuse them too. Then the request adopts the longer prefix as if it had matched it at
creation. A prefix the fetch had to shorten is adopted shorter: the request's committed count
drops to it (the engine recomputes the rest).
"""

from __future__ import annotations

from kvpool.cache.commits import Commits
from kvpool.cache.state import CacheContext, RequestState
from kvpool.errors import OutOfPagesError
from kvpool.records import Page
from kvpool.tokens import Token


class RemoteLoading:
    """The remote part of a request's reused prefix, loaded on first use (and adopted through
    `Commits`)."""

    def __init__(self, context: CacheContext, commits: Commits) -> None:
        self._ctx = context
        self._commits = commits

    def load(self, request: RequestState, level: int) -> bool:
        """Fetch the remote prefix into pages at `level` (or colder) and adopt it. False, with
        nothing changed and the prefix still pending, when no level has room for its pages."""
        prefix, remote = request._remote, self._ctx.remote
        assert prefix is not None and remote is not None
        end, payloads = remote.fetch(prefix)
        if end == prefix.start:
            self.forget(request)
            return True
        owners, migration, layout, tree = (
            self._ctx.owners,
            self._ctx.migration,
            self._ctx.layout,
            self._ctx.tree,
        )
        by_group: dict[int, list[tuple[int, memoryview]]] = {}
        for (index, g), payload in payloads.items():
            by_group.setdefault(g, []).append((index, payload))
        fetched: list[tuple[int, int, Page]] = []
        try:
            for g, items in by_group.items():
                pages = self._new_pages_at_or_below(level, layout.pool_group_of[g], g, len(items))
                fetched += [(index, g, page) for page, (index, _) in zip(pages, items, strict=True)]
                for page, (_, payload) in zip(pages, items, strict=True):
                    migration.write_page(page, payload)
        except BaseException as error:
            for _, _, page in fetched:
                owners.settle(page)  # unowned and in no block: freed
            if isinstance(error, OutOfPagesError):
                return False
            raise
        parent = (
            tree.root(request._scope_key)
            if prefix.parent_key == request._scope_key
            else tree.index.get(prefix.parent_key)
        )
        if parent is not None:
            count = end - prefix.start
            blocks, orphans = tree.insert_chain(parent, prefix.keys[:count], prefix.datas[:count])
            for orphan in orphans:
                owners.settle(orphan)
            for index, g, page in fetched:
                block = blocks[index - prefix.start]
                if (
                    block.pages[g] is None
                ):  # (else another request committed it meanwhile: keep that)
                    tree.attach(block, page)
            remote.note_hit(count)
        tokens = prefix.tokens[: end * request._tpb]
        self.forget(request)
        self._readopt(request, tokens)
        for _, _, page in fetched:
            owners.settle(page)  # held now, or freed when unused
        persist = self._ctx.state.persist
        if persist is not None:  # (pages written to a persistent disk level: records)
            persist.stored([page for _, _, page in fetched])
        return True

    def _new_pages_at_or_below(self, level: int, pool_group: int, g: int, count: int) -> list[Page]:
        allocation, state = self._ctx.allocation, self._ctx.state
        for candidate in range(level, len(state.levels)):
            try:
                return allocation.new_pages(candidate, pool_group, g, count)
            except OutOfPagesError:
                continue
        raise OutOfPagesError(f"no level has {count} slots for the fetched remote pages")

    def _readopt(self, request: RequestState, tokens: list[Token]) -> None:
        """Adopt the tree's longest usable match of `tokens` in place of the current one."""
        previous = self._release_adoption(request)
        match = self._ctx.tree.match(request._scope_key, tokens, False)
        self._commits.adopt_match(request, match, tokens)
        owners = self._ctx.owners
        for page in previous:
            owners.unhold(page)

    def _release_adoption(self, request: RequestState) -> list[Page]:
        """Clear the adopted prefix (only ever before the first resume); returns the pages it
        held, still held, for the caller to unhold once it holds the new ones."""
        held: list[Page] = []
        for g in range(len(request._pages)):
            held += [page for page in request._table.clear_all(g) if page is not None]
        held += [page for _, index, page in request._deferred if index < 0]
        request._deferred = []
        request._released_end = [0] * len(request._pages)
        request._prev_key = request._scope_key
        request._tail = []
        request._capacity = request._history = request._committed = request.reused_length = 0
        return held

    def forget(self, request: RequestState) -> None:
        request._remote = None
