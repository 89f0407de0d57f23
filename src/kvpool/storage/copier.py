"""Batched copies of whole slots between the pools of two levels.

Per pool, runs of consecutive slots become single copies: host<->host with numpy, host<->disk
with pwritev/preadv (gathering or scattering the runs of the other side). Copies with CUDA memory
on a side are torch copies on the manager's copy stream, ordered with the engine's stream by
events (`storage.device`), in as few launches as the slots allow: one per run consecutive on
both sides, or a gather on the device (`index_select`, `index_copy_`) and one transfer per run
consecutive on the host side; between a disk and the GPU, through two pinned buffers in turn
(a disk read or write overlaps the next transfer). Each pool's copy runs in a small thread pool,
so the pools of a group (and the caller) proceed in parallel; a large host<->host copy of one
pool is split among the threads too (one thread does not reach the memory bandwidth).

A copy's `CopyEvent` is what the next user of its destination slots, and the next owner of its
source slots, waits on. `check()` returns once every copy is done or, for a copy with CUDA
memory, enqueued: the GPU's side is ordered by its event, and the host waits for that event
(`wait()`) only before the CPU touches the bytes (`CopyEvent.on_device`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from kvpool.errors import StorageError
from kvpool.storage.device import DeviceOrder
from kvpool.storage.memory import Bytes, DeviceMemory, DiskMemory, HostMemory, Memory
from kvpool.storage.pools import PoolGroup


class CopyEvent:
    """Completion of one batched copy. `wait()` only waits (for a copy with CUDA memory: on its
    own event, never the whole device); `check()` raises the copy's error."""

    def __init__(
        self,
        futures: Sequence[Future[Any]],
        error: BaseException | None = None,
        device_events: Sequence[Any] = (),
        on_device: bool = False,
    ) -> None:
        self._futures = list(futures)
        self._error = error  # of a copy already done in the caller's thread
        self._device = list(device_events)  # CUDA events of copies enqueued here
        self._done = not self._futures and not self._device
        # A copy on the copy stream (its futures, if any, return its CUDA event): GPU work
        # after it is ordered by that event, with no host wait.
        self.on_device = on_device or bool(self._device)

    def _device_events(self) -> list[Any]:
        found = list(self._device)
        for future in self._futures:
            if future.done() and future.exception() is None and future.result() is not None:
                found.append(future.result())
        return found

    def is_set(self) -> bool:
        if not self._done:
            self._done = all(future.done() for future in self._futures) and all(
                event.query() for event in self._device_events()
            )
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
        for event in self._device_events():
            event.synchronize()
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


def is_device(memory: Memory) -> bool:
    return isinstance(memory, DeviceMemory) and memory.is_cuda


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
        self._order: DeviceOrder | None = None  # (made at the first copy with CUDA memory)
        self._staging = StagingBuffers()

    @property
    def order(self) -> DeviceOrder:
        """The copy stream and the engine's stream (CUDA only)."""
        if self._order is None:
            self._order = DeviceOrder()
        return self._order

    def copy(
        self, source: PoolGroup, destination: PoolGroup, pairs: Sequence[tuple[int, int]]
    ) -> CopyEvent:
        """Copy slot `s` of `source` to slot `d` of `destination` for every (s, d), all pools."""
        if not pairs:
            return CopyEvent([])
        if any(map(is_device, (*source.memories, *destination.memories))):
            return self._copy_device(source, destination, pairs)
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

    def _copy_device(
        self, source: PoolGroup, destination: PoolGroup, pairs: Sequence[tuple[int, int]]
    ) -> CopyEvent:
        """A copy with CUDA memory on a side: marked on the engine's stream here (the caller's
        thread), enqueued on the copy stream (pool by pool; a disk side in a worker thread)."""
        order = self.order
        mark = order.mark()
        work = list(zip(source.memories, destination.memories, source.slot_sizes, strict=True))
        disk = isinstance(source.memories[0], DiskMemory) or isinstance(
            destination.memories[0], DiskMemory
        )
        if disk:  # (file I/O in a thread: the caller goes on)
            futures = [
                self._pool.submit(
                    _copy_disk_device, order, mark, self._staging, src, dst, size, pairs
                )
                for src, dst, size in work
            ]
            return CopyEvent(futures, on_device=True)
        try:
            done = [order.issue(mark, _batch(src, dst, size, pairs)) for src, dst, size in work]
        except Exception as error:  # reported by check(), as a thread's would be
            return CopyEvent([], error)
        return CopyEvent([], device_events=done)

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
        self._staging.close()


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
        raise StorageError(
            22, f"no copy between {source.kind} and {destination.kind} memory here"
        )  # (CUDA memory is copied by Copier._copy_device)


Endpoint = Memory | Bytes  # a pool's memory, or a staging buffer's bytes


def _tensor(side: Endpoint) -> Any:
    """A torch view of one side of a copy: the CUDA tensor, or host bytes without a copy."""
    import torch

    if isinstance(side, np.ndarray):
        return torch.from_numpy(side)
    if isinstance(side, DeviceMemory) and side.is_cuda:
        return side.tensor
    array = _host_array(side)
    if array is None:
        raise StorageError(22, f"no torch view of {side.kind} memory")
    return torch.from_numpy(array)


def _on_device(side: Endpoint) -> bool:
    return not isinstance(side, np.ndarray) and is_device(side)


DIRECT_PIECES = 4  # up to this many pieces consecutive on both sides: one copy each


def _batch(
    source: Endpoint, destination: Endpoint, size: int, pairs: Sequence[tuple[int, int]]
) -> Callable[[], None]:
    """The copies of one pool between a CUDA memory and another CUDA or host memory, to be
    enqueued on the copy stream: one per piece consecutive on both sides when there are few;
    otherwise a gather and a scatter on the device around one transfer per run consecutive on
    the host side (or one `index_select` + `index_copy_` between two CUDA memories)."""

    def enqueue() -> None:
        import torch

        src, dst = _tensor(source), _tensor(destination)
        src_rows, dst_rows = src[: src.numel() // size * size], dst[: dst.numel() // size * size]
        src_rows, dst_rows = src_rows.view(-1, size), dst_rows.view(-1, size)
        pieces = [piece for run in runs(pairs) for piece in contiguous(run, 1)]
        if len(pieces) <= DIRECT_PIECES:
            for s, d, n in pieces:
                dst_rows[d : d + n].copy_(src_rows[s : s + n], non_blocking=True)
            return
        device = (src if _on_device(source) else dst).device
        if _on_device(source) and _on_device(destination):
            index = torch.tensor(pairs, dtype=torch.int64).to(device, non_blocking=True)
            dst_rows.index_copy_(0, index[:, 1], src_rows.index_select(0, index[:, 0]))
        elif _on_device(destination):  # host -> GPU: a transfer per host run, then a scatter
            ordered = [pair for run in runs(pairs) for pair in run]
            staged = torch.empty((len(ordered), size), dtype=torch.uint8, device=device)
            at = 0
            for s, _, n in contiguous(ordered, 0):
                staged[at : at + n].copy_(src_rows[s : s + n], non_blocking=True)
                at += n
            index = torch.tensor([d for _, d in ordered], dtype=torch.int64).to(device)
            dst_rows.index_copy_(0, index, staged)
        else:  # GPU -> host: a gather, then a transfer per host run
            ordered = [pair for run in runs(pairs, by_destination=True) for pair in run]
            index = torch.tensor([s for s, _ in ordered], dtype=torch.int64).to(device)
            gathered = src_rows.index_select(0, index)
            at = 0
            for _, d, n in contiguous(ordered, 1):
                dst_rows[d : d + n].copy_(gathered[at : at + n], non_blocking=True)
                at += n

    return enqueue


STAGING_BYTES = 16 << 20  # each of the two pinned buffers between a disk and the GPU


class StagingBuffers:
    """Two pinned host buffers a disk <-> GPU copy alternates between (made on first use),
    each with the event of the last transfer that used it."""

    def __init__(self, nbytes: int | None = None) -> None:
        self.nbytes = nbytes or STAGING_BYTES
        self.buffers: list[HostMemory] = []
        self.busy: list[Any] = [None, None]
        self.lock = threading.Lock()  # (one disk <-> GPU copy at a time uses them)

    def get(self, index: int) -> HostMemory:
        if not self.buffers:
            self.buffers = [HostMemory(self.nbytes), HostMemory(self.nbytes)]
            for buffer in self.buffers:
                buffer.pin()
        busy = self.busy[index]
        if busy is not None:
            busy.synchronize()  # (its last transfer read or filled it: done before reuse)
            self.busy[index] = None
        return self.buffers[index]

    def close(self) -> None:
        for buffer in self.buffers:
            buffer.close()
        self.buffers = []


def _copy_disk_device(
    order: DeviceOrder,
    mark: tuple[Any, Any],
    staging: StagingBuffers,
    source: Memory,
    destination: Memory,
    size: int,
    pairs: Sequence[tuple[int, int]],
) -> Any:
    """A copy between a disk and a CUDA memory through the two pinned buffers in turn: while
    one buffer's bytes cross the link, the other is read from or written to the file. Returns
    the event of the last transfer onto the GPU (None: the bytes are on disk already)."""
    to_disk = isinstance(destination, DiskMemory)
    per_buffer = max(1, staging.nbytes // size)
    ordered = [pair for run in runs(pairs, by_destination=to_disk) for pair in run]
    chunks = [ordered[i : i + per_buffer] for i in range(0, len(ordered), per_buffer)]
    last = None
    with staging.lock:
        pending: tuple[Any, Bytes, list[tuple[int, int]]] | None = None
        for number, chunk in enumerate(chunks):
            rows = staging.get(number % 2).array[: len(chunk) * size]
            if to_disk:  # GPU -> this buffer now; the other buffer -> the file meanwhile
                moves = [(s, i) for i, (s, _) in enumerate(chunk)]
                event = order.issue(mark, _batch(source, rows, size, moves))
                staging.busy[number % 2] = event
                if pending is not None:
                    _write_chunk(*pending, destination, size)
                pending = (event, rows, chunk)
            else:  # the file -> this buffer, then this buffer -> GPU (the other one may run)
                at = 0
                for run in runs(chunk):
                    source.readv(  # type: ignore[attr-defined]
                        run[0][0] * size, [rows[at * size : (at + len(run)) * size]]
                    )
                    at += len(run)
                moves = [(i, d) for i, (_, d) in enumerate(chunk)]
                last = order.issue(mark, _batch(rows, destination, size, moves))
                staging.busy[number % 2] = last
        if pending is not None:
            _write_chunk(*pending, destination, size)
    return last


def _write_chunk(
    event: Any, rows: Bytes, chunk: list[tuple[int, int]], disk: Memory, size: int
) -> None:
    event.synchronize()  # (the transfer into this buffer only)
    for run in runs([(i, d) for i, (_, d) in enumerate(chunk)], by_destination=True):
        at = run[0][0]
        disk.writev(  # type: ignore[attr-defined]
            run[0][1] * size, [rows[at * size : (at + len(run)) * size]]
        )
