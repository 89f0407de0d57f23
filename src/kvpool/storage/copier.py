"""Batched copies of whole slots between the pools of two levels.

Per pool, runs of consecutive slots become single copies: host<->host with numpy, host<->disk
with pwritev/preadv (gathering or scattering the runs of the other side). Copies with CUDA memory
on a side are torch copies on the manager's copy stream, ordered with the engine's stream by
events (`storage.device`), in as few launches as the slots allow (`storage.cuda_copies`):
with pinned host memory directly; with a disk, or host memory that is not pinned (pages staged
in RAM), through two pinned buffers in turn, in a worker thread. Each pool's copy runs in a
small thread pool, so the pools of a group (and the caller) proceed in parallel; a large
host<->host copy of one pool is split among the threads too (one thread does not reach the
memory bandwidth).

A copy's `CopyEvent` is what the next user of its destination slots, and the next owner of its
source slots, waits on. `check()` returns once every copy is done or, for a copy with CUDA
memory, enqueued: the GPU's side is ordered by its event, and the host waits for that event
(`wait()`) only before the CPU touches the bytes (`CopyEvent.on_device`). The memories of the
levels are attached to the copier (`attach`): a host memory waits for the copy stream
(`drain`) before it unregisters, remaps or frees memory a copy may use, and the GPU level's
resizes, reads and writes run on the copy stream; `close` drains it before anything is freed.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from kvpool.errors import StorageError
from kvpool.storage.cuda_copies import (
    StagingBuffers,
    batch,
    copy_staged,
    host_array,
    is_device,
    pageable,
)
from kvpool.storage.device import DeviceOrder
from kvpool.storage.device_memory import DeviceMemory
from kvpool.storage.memory import DiskMemory, HostMemory, Memory
from kvpool.storage.pools import PoolGroup
from kvpool.storage.runs import contiguous, runs


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
        thread), enqueued on the copy stream pool by pool; a disk or pageable host side through
        the pinned buffers, in a worker thread (the caller goes on)."""
        order = self.order
        mark = order.mark()
        futures: list[Future[Any]] = []
        done: list[Any] = []
        try:
            for src, dst, size in zip(
                source.memories, destination.memories, source.slot_sizes, strict=True
            ):
                if self._staged(src) or self._staged(dst):
                    futures.append(
                        self._pool.submit(
                            copy_staged, order, mark, self._staging, src, dst, size, pairs
                        )
                    )
                else:
                    done.append(order.issue(mark, batch(src, dst, size, pairs)))
        except Exception as error:  # reported by check(), as a thread's would be
            return CopyEvent(futures, error, done, on_device=True)
        return CopyEvent(futures, device_events=done, on_device=True)

    def _staged(self, memory: Memory) -> bool:
        """Whether a side goes through the pinned buffers: a disk; host memory that is not
        pinned, where the buffers are (else it is copied as it is, pageable)."""
        if isinstance(memory, DiskMemory):
            return True
        if not pageable(memory):
            return False
        if self._staging.pinnable is None:
            with self._staging.lock:
                self._staging.make()
        return bool(self._staging.pinnable)

    def attach(self, memories: Iterable[Memory]) -> None:
        """Order the levels' memories with this copier's copies: a host memory drains the
        copy stream before it unregisters, remaps or frees what a copy may use; a CUDA memory
        resizes, reads and writes on the copy stream, after the engine's marked work."""
        for memory in memories:
            if isinstance(memory, HostMemory):
                memory.drain = self.drain
            elif isinstance(memory, DeviceMemory) and memory.is_cuda:
                memory.order = self.order

    def drain(self) -> None:
        """Wait for every copy issued on the copy stream (nothing without one)."""
        if self._order is not None:
            self._order.drain()

    def _parts(
        self, source: Memory, destination: Memory, size: int, pairs: Sequence[tuple[int, int]]
    ) -> list[Sequence[tuple[int, int]]]:
        """`pairs` in consecutive parts for the threads: one part unless the copy is between
        host memories and large (the parts touch disjoint slots: a destination is a free slot)."""
        count = min(self._parts_per_copy, len(pairs) * size // self._split_bytes)
        if count < 2 or host_array(source) is None or host_array(destination) is None:
            return [pairs]
        step = -(-len(pairs) // count)
        return [pairs[start : start + step] for start in range(0, len(pairs), step)]

    def close(self) -> None:
        """After every copy: the threads' (their disk and RAM sides) and the copy stream's
        (host levels are unmapped and the staging buffers freed after this)."""
        self._pool.shutdown(wait=True)
        self.drain()
        self._staging.close()


def _copy_pool(
    source: Memory, destination: Memory, size: int, pairs: Sequence[tuple[int, int]]
) -> None:
    src_host, dst_host = host_array(source), host_array(destination)
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
