"""Batched copies of whole slots between the pools of two levels.

Per pool, runs of consecutive slots become single copies: host<->host with numpy, host<->disk
with pwritev/preadv (gathering or scattering the runs of the other side), GPU<->host with torch
copies on a side stream when CUDA is present. Each pool's copy runs in a small thread pool, so the
pools of a group (and the caller) proceed in parallel; a large host<->host copy of one pool is
split among the threads too (one thread does not reach the memory bandwidth). A copy's
`CopyEvent` is what the next user of its destination slots, and the next owner of its source
slots, waits on.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from kvpool.errors import StorageError
from kvpool.storage.memory import Bytes, DeviceMemory, DiskMemory, HostMemory, Memory
from kvpool.storage.pools import PoolGroup


class CopyEvent:
    """Completion of one batched copy. `wait()` only waits; `check()` raises the copy's error."""

    def __init__(self, futures: Sequence[Future[None]], error: BaseException | None = None) -> None:
        self._futures = list(futures)
        self._error = error  # of a copy already done in the caller's thread
        self._done = not self._futures

    def is_set(self) -> bool:
        if not self._done:
            self._done = all(future.done() for future in self._futures)
        return self._done

    def _finish(self) -> None:
        """Wait for every part of the copy, through further interrupts."""
        while not all(future.done() for future in self._futures):
            try:
                futures.wait(self._futures)
            except BaseException:  # another Ctrl-C: keep waiting (copies are short)
                continue

    def wait(self, timeout: float | None = None) -> bool:
        for future in self._futures:
            try:
                future.exception(timeout)
            except TimeoutError:
                return False
        return True

    def check(self) -> None:
        """Wait, then raise `StorageError` if any part of the copy failed. Interrupted while
        waiting (Ctrl-C), it lets the copy finish before the interrupt goes on: the caller then
        frees slots that no thread writes into any more."""
        try:
            errors = [future.exception() for future in self._futures]
        except BaseException:
            self._finish()
            raise
        for error in [self._error, *errors]:
            if error is not None:
                if isinstance(error, StorageError):
                    raise error
                raise StorageError(
                    getattr(error, "errno", None) or 5, f"copy failed: {error}"
                ) from error


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


def _host_array(memory: Memory) -> Bytes | None:
    if isinstance(memory, HostMemory):
        return memory.array
    if isinstance(memory, DeviceMemory) and not memory.is_cuda:
        return memory.host.array
    return None


INLINE_COPY_BYTES = 64 << 10  # smaller copies run in the caller's thread
SPLIT_COPY_BYTES = 8 << 20  # a host<->host copy of a pool is split into parts at least this big


class Copier:
    """Runs batched slot copies in a small thread pool (small ones in the caller's thread)."""

    def __init__(
        self,
        workers: int = 4,
        inline_bytes: int = INLINE_COPY_BYTES,
        split_bytes: int = SPLIT_COPY_BYTES,
    ) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvpool-copy")
        self._parts_per_copy = min(workers, os.cpu_count() or 1)
        self._inline_bytes = inline_bytes
        self._split_bytes = split_bytes

    def copy(
        self, source: PoolGroup, destination: PoolGroup, pairs: Sequence[tuple[int, int]]
    ) -> CopyEvent:
        """Copy slot `s` of `source` to slot `d` of `destination` for every (s, d), all pools."""
        if not pairs:
            return CopyEvent([])
        work = zip(source.memories, destination.memories, source.slot_sizes, strict=True)
        if len(pairs) * sum(source.slot_sizes) <= self._inline_bytes:
            # Handing a small copy to a thread costs more than the copy: do it here.
            try:
                for src_memory, dst_memory, size in work:
                    _copy_pool(src_memory, dst_memory, size, pairs)
            except Exception as error:  # reported by check(), as a thread's would be
                return CopyEvent([], error)
            return CopyEvent([])
        futures = [
            self._pool.submit(_copy_pool, src_memory, dst_memory, size, part)
            for src_memory, dst_memory, size in work
            for part in self._parts(src_memory, dst_memory, size, pairs)
        ]
        return CopyEvent(futures)

    def _parts(
        self, source: Memory, destination: Memory, size: int, pairs: Sequence[tuple[int, int]]
    ) -> list[Sequence[tuple[int, int]]]:
        """`pairs` in consecutive parts for the threads: one part unless the copy is between
        host memories and large (the parts touch disjoint slots: a destination is a free slot)."""
        count = min(self._parts_per_copy, len(pairs) * size // self._split_bytes)
        if count < 2 or _host_array(source) is None or _host_array(destination) is None:
            return [pairs]
        step = -(-len(pairs) // count)
        return [pairs[start : start + step] for start in range(0, len(pairs), step)]

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _copy_pool(
    source: Memory, destination: Memory, size: int, pairs: Sequence[tuple[int, int]]
) -> None:
    src_host, dst_host = _host_array(source), _host_array(destination)
    if src_host is not None and dst_host is not None:
        for run in runs(pairs):
            for s, d, n in contiguous(run, 1):
                dst_host[d * size : (d + n) * size] = src_host[s * size : (s + n) * size]
    elif src_host is not None and isinstance(destination, DiskMemory):
        for run in runs(pairs, by_destination=True):  # consecutive in the file: one pwritev
            pieces = contiguous(run, 0)
            destination.writev(
                run[0][1] * size, [src_host[s * size : (s + n) * size] for s, _, n in pieces]
            )
    elif isinstance(source, DiskMemory) and dst_host is not None:
        for run in runs(pairs):  # consecutive in the file: one preadv
            pieces = contiguous(run, 1)
            source.readv(
                run[0][0] * size, [dst_host[d * size : (d + n) * size] for _, d, n in pieces]
            )
    elif isinstance(source, DiskMemory) and isinstance(destination, DiskMemory):
        for run in runs(pairs):
            buffer = np.empty(len(run) * size, dtype=np.uint8)
            source.readv(run[0][0] * size, [buffer])
            for index, (_, d) in enumerate(run):
                destination.writev(d * size, [buffer[index * size : (index + 1) * size]])
    else:
        _copy_cuda(source, destination, size, pairs)


def _copy_cuda(
    source: Memory, destination: Memory, size: int, pairs: Sequence[tuple[int, int]]
) -> None:
    """Copies with a CUDA level on at least one side, on a side stream."""
    import torch

    def tensor_of(memory: Memory) -> Any:
        if isinstance(memory, DeviceMemory) and memory.is_cuda:
            return memory.tensor
        array = _host_array(memory)
        if array is None:
            raise StorageError(
                22, f"no direct copy between {source.kind} and {destination.kind} memory"
            )
        return torch.from_numpy(array)

    if isinstance(source, DiskMemory) or isinstance(destination, DiskMemory):
        # No direct path between a file and CUDA memory: bounce each run through host memory.
        for run in runs(pairs):
            for s, d, n in contiguous(run, 1):
                data = source.read(s * size, n * size)
                destination.write(d * size, data)
        return
    src, dst = tensor_of(source), tensor_of(destination)
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call,unused-ignore]
    with torch.cuda.stream(stream):
        for run in runs(pairs):
            for s, d, n in contiguous(run, 1):
                dst[d * size : (d + n) * size].copy_(
                    src[s * size : (s + n) * size], non_blocking=True
                )
    stream.synchronize()
