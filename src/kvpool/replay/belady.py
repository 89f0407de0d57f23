"""The offline optimum of prefix caching (Belady), as a reference line for `kvpool replay
--capacity-blocks ... --policy belady`: no online policy can do better on the same replay.

Same semantics as the manager's prefix-cache mode (and the independent simulator whose
"optimal" it reproduces exactly): N blocks of 512 tokens, requests in order, the first half warms
up, a request's hit is its longest cached prefix. With the whole future known, each block that
must make room goes to the cached leaf used again the latest (never, first), never one of the
current request's blocks; and a new block that would be used again later than every such leaf
is not cached at all (nor the rest of its request), which is what the optimum does.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from kvpool.replay.results import PrefixCacheResult
from kvpool.replay.workloads import MOONCAKE_BLOCK, Request


def block_chains(requests: Sequence[Request]) -> list[list[int]]:
    """Each request's blocks as node ids of one prefix tree (equal ids: equal prefixes)."""
    nodes: dict[tuple[int, object], int] = {}
    chains = []
    for request in requests:
        chain, parent = [], -1
        if request.block_ids:
            pieces: Sequence[object] = request.block_ids
        else:
            tokens = request.tokens()
            pieces = [
                tuple(tokens[i : i + MOONCAKE_BLOCK]) for i in range(0, len(tokens), MOONCAKE_BLOCK)
            ]
        for piece in pieces:
            parent = nodes.setdefault((parent, piece), len(nodes))
            chain.append(parent)
        chains.append(chain)
    return chains


def belady_hit_rate(
    requests: Sequence[Request],
    capacity_blocks: int,
    warmup_fraction: float = 0.5,
    progress: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> PrefixCacheResult:
    """The optimal hit rate of `requests` with `capacity_blocks` blocks."""
    chains = block_chains(requests)
    uses: dict[int, list[int]] = {}
    for index, chain in enumerate(chains):
        for node in chain:
            uses.setdefault(node, []).append(index)
    never = len(chains)  # (later than any request)
    cursor = dict.fromkeys(uses, 0)

    def next_use(node: int, index: int) -> int:
        times, at = uses[node], cursor[node]
        while at < len(times) and times[at] <= index:
            at += 1
        cursor[node] = at
        return times[at] if at < len(times) else never

    parent: dict[int, int] = {}
    children: dict[int, int] = {}
    version: dict[int, int] = {}
    due: dict[int, int] = {}  # next use of each cached node
    leaves: list[tuple[int, int, int]] = []  # (-next use, version, node): latest first
    size = measured = hits = 0
    warmup = int(len(chains) * warmup_fraction)
    partial = False

    def latest_leaf(path: set[int], aside: list[tuple[int, int, int]]) -> int | None:
        while leaves:
            _, v, node = leaves[0]
            if node in parent and version[node] == v and children[node] == 0:
                if node not in path:
                    return node
                aside.append(heapq.heappop(leaves))
                continue
            heapq.heappop(leaves)
        return None

    for index, (request, chain) in enumerate(zip(requests, chains, strict=True)):
        if should_stop is not None and should_stop():
            partial = True
            break
        if progress is not None and index % 256 == 0:
            progress(index, len(requests))
        depth = 0
        for node in chain:
            if node not in parent:
                break
            depth += 1
        if index >= warmup:
            measured += request.input_length
            hits += min(request.input_length, depth * MOONCAKE_BLOCK)
        path, previous = set(chain), -1
        aside: list[tuple[int, int, int]] = []
        for node in chain:
            if node not in parent:
                if size >= capacity_blocks:
                    victim = latest_leaf(path, aside)
                    if victim is None or due[victim] <= next_use(node, index):
                        break  # not worth caching: nor is the rest of the request
                    up = parent.pop(victim)
                    del children[victim], due[victim]
                    version[victim] += 1
                    size -= 1
                    if up >= 0:
                        children[up] -= 1
                        if children[up] == 0:
                            heapq.heappush(leaves, (-due[up], version[up], up))
                parent[node], children[node] = previous, 0
                version.setdefault(node, 0)
                size += 1
                if previous >= 0:
                    children[previous] += 1
            due[node] = next_use(node, index)
            version[node] += 1
            if children[node] == 0:
                heapq.heappush(leaves, (-due[node], version[node], node))
            previous = node
        for item in aside:
            heapq.heappush(leaves, item)
    return PrefixCacheResult(
        capacity_blocks, "belady", measured, hits, max(0, len(requests) - warmup), partial
    )


__all__ = ["belady_hit_rate", "block_chains"]
