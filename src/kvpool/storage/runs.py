"""Slot pairs grouped into runs: what turns a batch of slot copies into few large ones."""

from __future__ import annotations

from collections.abc import Sequence


def runs(
    pairs: Sequence[tuple[int, int]], by_destination: bool = False
) -> list[list[tuple[int, int]]]:
    """Split (source, destination) slot pairs into runs that are consecutive on one side
    (destination if `by_destination`, else source), sorted by that side."""
    side = 1 if by_destination else 0
    ordered = sorted(pairs, key=lambda pair: pair[side])
    result: list[list[tuple[int, int]]] = []
    for pair in ordered:
        if result and pair[side] == result[-1][-1][side] + 1:
            result[-1].append(pair)
        else:
            result.append([pair])
    return result


def contiguous(run: Sequence[tuple[int, int]], side: int) -> list[tuple[int, int, int]]:
    """Sub-runs of `run` consecutive on `side` too: (source start, destination start, count)."""
    pieces: list[tuple[int, int, int]] = []
    for src, dst in run:
        if pieces:
            s, d, n = pieces[-1]
            if (src, dst)[side] == (s, d)[side] + n:
                pieces[-1] = (s, d, n + 1)
                continue
        pieces.append((src, dst, 1))
    return pieces


def split_at(
    pieces: Sequence[tuple[int, int, int]], side: int, every: int | None
) -> list[tuple[int, int, int]]:
    """`pieces` (source start, destination start, count) cut where `side`'s slot crosses a
    multiple of `every` (None: uncut): no piece spans two of `every`-slot blocks on that side."""
    if every is None:
        return list(pieces)
    cut: list[tuple[int, int, int]] = []
    for s, d, n in pieces:
        while n:
            start = (s, d)[side]
            take = min(n, every - start % every)
            cut.append((s, d, take))
            s, d, n = s + take, d + take, n - take
    return cut


__all__ = ["contiguous", "runs", "split_at"]
