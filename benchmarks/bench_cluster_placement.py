"""Where the shared tier's keys land on a Valkey cluster, per key layout: load balance per node
(keys and bytes) and the remote hits left after one node fails, on a Mooncake trace.

Offline and exact: the trace's requests are expanded into kvpool blocks (each 512-token hash
id is 512 / --tokens-per-block blocks), each block's key is chained as kvpool chains it, and its
hash slot is the one the cluster computes (CRC16 of the hash tag, `valkey.crc.key_slot`) for
the key layout under test; the 16,384 slots are split evenly over --nodes. A request's remote
hit is the longest prefix of its blocks an earlier request stored (every block is written back
once); after a node fails it ends at the first block whose slot that node served. Ratios are
against today's layout (`block`: each block's key in its own slot), computed in the same run.

    python benchmarks/bench_cluster_placement.py /work/shared/traces/mooncake_conversation_trace.jsonl \
        --requests 4000 --hot 20

(`--hot 20`: a block that 20 earlier requests used is taken as held locally, so a request's
remote part starts after it, as it does in an engine whose local levels hold the shared
system prompt.) The first layout is the baseline of the ratios.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys

from valkey.crc import key_slot

SLOTS = 16384


def load(path: str, limit: int | None) -> list[list[int]]:
    with open(path) as f:
        rows = [json.loads(line)["hash_ids"] for line in f if line.strip()]
    return rows[:limit] if limit else rows


def chains(trace: list[list[int]], per_id: int) -> list[list[bytes]]:
    """Each request's chained block keys (a hash id expands into `per_id` blocks)."""
    out = []
    for ids in trace:
        key, keys = b"scope", []
        for hid in ids:
            for sub in range(per_id):
                key = hashlib.sha256(key + hid.to_bytes(8, "little") + bytes([sub])).digest()
                keys.append(key)
        out.append(keys)
    return out


def tags(keys: list[bytes], layout: str) -> list[bytes]:
    """The hash tag of each block of a chain under `layout`: "block" (its own key: no tag),
    "root" (the chain's first block), "segment:N" (the first block of its N-block segment),
    "doubling" (blocks [2^k, 2^(k+1)) share block 2^k's), "anchor:A" (blocks before A their
    own, the rest block A's) or "kvpool:A" (kvpool's: blocks before A the first block's, the
    rest block A's; `placement_tokens` = A blocks)."""
    name, _, arg = layout.partition(":")
    n = len(keys)
    if name == "block":
        return keys
    if name == "root":
        return [keys[0]] * n
    if name == "segment":
        size = int(arg)
        return [keys[i // size * size] for i in range(n)]
    if name == "doubling":
        return [keys[1 << (i.bit_length() - 1)] if i else keys[0] for i in range(n)]
    if name == "anchor":
        a = int(arg)
        return [keys[i] if i < a else keys[a] for i in range(n)]
    if name == "kvpool":
        a = int(arg)
        return [keys[0] if i < a else keys[a] for i in range(n)]
    raise SystemExit(
        f"--layouts: {layout!r} is not one of block, root, segment:N, doubling, anchor:A, kvpool:A"
    )


def evaluate(all_chains: list[list[bytes]], layout: str, nodes: int, hot: int) -> dict[str, float]:
    per_node = SLOTS // nodes

    def node_of(tag: bytes) -> int:
        return min(key_slot(b"{" + tag.hex()[:16].encode() + b"}") // per_node, nodes - 1)

    stored: dict[bytes, int] = {}  # key -> node
    uses: dict[bytes, int] = {}  # key -> requests that used it
    keys_per_node = [0] * nodes
    hits = [0] + [0] * nodes  # [0]: all nodes alive; [1 + n]: node n dead
    for keys in all_chains:
        places = [node_of(t) for t in tags(keys, layout)]
        prefix = 0
        while prefix < len(keys) and keys[prefix] in stored:
            prefix += 1
        # a hot prefix (used by `hot` requests before) is local: the remote part starts after it
        start = 0
        while start < prefix and uses.get(keys[start], 0) >= hot:
            start += 1
        hits[0] += prefix - start
        for dead in range(nodes):
            end = next((i for i in range(start, prefix) if places[i] == dead), prefix)
            hits[1 + dead] += end - start
        for key in keys:
            uses[key] = uses.get(key, 0) + 1
        for key, node in zip(keys, places, strict=True):
            if key not in stored:
                stored[key] = node
                keys_per_node[node] += 1
    mean = statistics.fmean(keys_per_node)
    after = statistics.fmean(hits[1:])
    return {
        "max_over_mean": max(keys_per_node) / mean,
        "min_over_mean": min(keys_per_node) / mean,
        "hits": hits[0],
        "hits_after_failure": after,
        "kept": after / hits[0] if hits[0] else 0.0,
        "worst_kept": min(hits[1:]) / hits[0] if hits[0] else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--nodes", type=int, nargs="+", default=[3, 6, 12])
    parser.add_argument("--tokens-per-block", type=int, default=32)
    parser.add_argument(
        "--layouts", nargs="+",
        default=["block", "segment:64", "doubling", "anchor:16", "root", "kvpool:16", "kvpool:32"],
    )  # fmt: skip
    parser.add_argument(
        "--hot", type=int, default=10**9,
        help="count remote hits past blocks that this many earlier requests used (local)",
    )  # fmt: skip
    parser.add_argument("--requests", type=int, default=None)
    args = parser.parse_args(argv)
    if 512 % args.tokens_per_block:
        parser.error(f"--tokens-per-block={args.tokens_per_block}: a divisor of 512")
    all_chains = chains(load(args.trace, args.requests), 512 // args.tokens_per_block)
    blocks = sum(len(c) for c in all_chains)
    print(f"{len(all_chains)} requests, {blocks} blocks of {args.tokens_per_block} tokens")
    print("(keys and bytes per node are proportional: every value of a layout has one size)")
    header = "nodes  layout       max/mean keys  min/mean  hits kept after 1 node fails (worst)"
    for nodes in args.nodes:
        print(header)
        base = None
        for layout in args.layouts:
            r = evaluate(all_chains, layout, nodes, args.hot)
            base = base or r
            print(
                f"{nodes:>5}  {layout:<12} {r['max_over_mean']:>14.2f}  {r['min_over_mean']:>8.2f}"
                f"  {r['kept']:>6.1%} ({r['worst_kept']:.1%}; "
                f"{r['kept'] / base['kept']:.2f}x block)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
