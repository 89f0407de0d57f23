"""The copies with CUDA memory on a side, as they are enqueued on the copy stream
(`storage.device` orders them with the engine's stream; `storage.copier` routes to them).

- Between CUDA memory and pinned host memory (or two CUDA memories): one copy per piece
  consecutive on both sides when there are few; otherwise a gather or scatter on the device
  (`index_select`, `index_copy_`) around one transfer per run consecutive on the host side.
  The gather's or scatter's GPU temporary holds at most `GATHER_BYTES` (a large batch goes in
  chunks: a resume of many GiB on a nearly full GPU does not run out of memory), and a transfer
  never spans two of the host memory's registered pieces (it would be a pageable one). Index
  tensors go from pinned memory without blocking (`device.index_tensor`).
- Between CUDA memory and a disk, or host memory that is not pinned (pages staged in RAM):
  through two pinned buffers in turn (`StagingBuffers`): while one buffer's bytes cross the
  link, the other is filled from or emptied to the file or the pageable memory. Each buffer
  holds at least one slot: it is made again at the largest slot's size when a larger one comes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.errors import StorageError
from kvpool.storage.device import DeviceOrder, index_tensor
from kvpool.storage.device_memory import DeviceMemory
from kvpool.storage.memory import PAGE_SIZE, Bytes, DiskMemory, HostMemory, Memory
from kvpool.storage.runs import contiguous, runs, split_at

DIRECT_PIECES = 4  # up to this many pieces consecutive on both sides: one copy each
GATHER_BYTES = 64 << 20  # the most a gather's or scatter's temporary holds on the GPU
STAGING_BYTES = 16 << 20  # each of the two pinned buffers (at least one slot)

Endpoint = Memory | Bytes  # a pool's memory, or a staging buffer's bytes


def is_device(memory: Memory) -> bool:
    return isinstance(memory, DeviceMemory) and memory.is_cuda


def host_array(memory: Memory) -> Bytes | None:
    """The bytes of a host memory (or of host memory standing in for a GPU); None otherwise."""
    if isinstance(memory, HostMemory):
        return memory.array
    if isinstance(memory, DeviceMemory) and not memory.is_cuda:
        return memory.host.array
    return None


def pageable(memory: Memory) -> bool:
    """Host memory whose used range is not all registered with the driver (a copy with the GPU
    from it would be synchronous: the host would wait for the copy stream)."""
    return isinstance(memory, HostMemory) and memory.pinned < memory.size


def _tensor(side: Endpoint) -> Any:
    """A torch view of one side of a copy: the CUDA tensor, or host bytes without a copy."""
    import numpy as np
    import torch

    if isinstance(side, np.ndarray):
        return torch.from_numpy(side)
    if isinstance(side, DeviceMemory) and side.is_cuda:
        return side.tensor
    array = host_array(side)
    if array is None:
        raise StorageError(22, f"no torch view of {side.kind} memory")
    return torch.from_numpy(array)


def _on_device(side: Endpoint) -> bool:
    return isinstance(side, Memory) and is_device(side)


def _rows_per_registration(side: Endpoint, size: int) -> int | None:
    """Slots per registered piece of a pinned host memory (a transfer must stay in one); None:
    no limit (a staging buffer, one registration)."""
    if isinstance(side, HostMemory) and side.pinned and side.pin_piece % size == 0:
        return side.pin_piece // size
    return None


def _chunks(pairs: Sequence[tuple[int, int]], step: int) -> list[Sequence[tuple[int, int]]]:
    return [pairs[start : start + step] for start in range(0, len(pairs), step)]


def batch(
    source: Endpoint, destination: Endpoint, size: int, pairs: Sequence[tuple[int, int]]
) -> Callable[[], None]:
    """The copies of one pool between a CUDA memory and another CUDA or pinned host memory
    (or a staging buffer), to be enqueued on the copy stream (`DeviceOrder.issue`)."""

    def enqueue() -> None:
        import torch

        src, dst = _tensor(source), _tensor(destination)
        src_rows = src[: src.numel() // size * size].view(-1, size)
        dst_rows = dst[: dst.numel() // size * size].view(-1, size)
        on_src, on_dst = _on_device(source), _on_device(destination)
        host_side = 1 if on_src else 0  # (the side of the host memory, if one is)
        every = None
        if not (on_src and on_dst):
            every = _rows_per_registration(destination if on_src else source, size)
        pieces = [piece for run in runs(pairs) for piece in contiguous(run, 1)]
        pieces = split_at(pieces, host_side, every)
        if len(pieces) <= DIRECT_PIECES:
            for s, d, n in pieces:
                dst_rows[d : d + n].copy_(src_rows[s : s + n], non_blocking=True)
            return
        device = (src if on_src else dst).device
        step = max(1, GATHER_BYTES // size)  # (rows of a GPU temporary)
        if on_src and on_dst:
            for chunk in _chunks(pairs, step):
                index = index_tensor(chunk, device)
                dst_rows.index_copy_(0, index[:, 1], src_rows.index_select(0, index[:, 0]))
        elif on_dst:  # host -> GPU: a transfer per host run into a temporary, then a scatter
            ordered = [pair for run in runs(pairs) for pair in run]
            for chunk in _chunks(ordered, step):
                staged = torch.empty((len(chunk), size), dtype=torch.uint8, device=device)
                at = 0
                for s, _, n in split_at(contiguous(chunk, 0), 0, every):
                    staged[at : at + n].copy_(src_rows[s : s + n], non_blocking=True)
                    at += n
                dst_rows.index_copy_(0, index_tensor([d for _, d in chunk], device), staged)
                del staged  # (back to the allocator, for the next chunk on this stream)
        else:  # GPU -> host: a gather into a temporary, then a transfer per host run
            ordered = [pair for run in runs(pairs, by_destination=True) for pair in run]
            for chunk in _chunks(ordered, step):
                gathered = src_rows.index_select(0, index_tensor([s for s, _ in chunk], device))
                at = 0
                for _, d, n in split_at(contiguous(chunk, 1), 1, every):
                    dst_rows[d : d + n].copy_(gathered[at : at + n], non_blocking=True)
                    at += n
                del gathered

    return enqueue


class StagingBuffers:
    """Two pinned host buffers a staged copy alternates between (made on first use, made again
    larger for a slot larger than they are), each with the event of the last transfer that
    used it."""

    def __init__(self, nbytes: int | None = None) -> None:
        self.nbytes = nbytes or STAGING_BYTES
        self.buffers: list[HostMemory] = []
        self.busy: list[Any] = [None, None]
        self.turn = 0  # the buffer the next chunk uses (the turns go on across copies)
        self.pinnable: bool | None = None  # whether the driver pinned them (None: not made)
        self.lock = threading.Lock()  # (one staged copy at a time uses them)

    def fit(self, size: int) -> int:
        """How many slots of `size` bytes a buffer holds: at least one (buffers smaller than
        the slot are made again at its size, after their last transfers)."""
        if size > self.nbytes:
            self.close()
            self.nbytes = -(-size // PAGE_SIZE) * PAGE_SIZE
        return self.nbytes // size

    def make(self) -> bool:
        """Make and pin the buffers if not made yet; whether the driver pinned them."""
        if not self.buffers:
            self.buffers = [HostMemory(self.nbytes), HostMemory(self.nbytes)]
            for buffer in self.buffers:
                buffer.pin_unit = self.nbytes  # (one registration each)
                buffer.pin()
            self.pinnable = all(buffer.pinned >= buffer.size for buffer in self.buffers)
        return bool(self.pinnable)

    def next(self) -> tuple[int, HostMemory]:
        """The next buffer in turn, once its last transfer is done."""
        self.make()
        index, self.turn = self.turn, self.turn ^ 1
        busy = self.busy[index]
        if busy is not None:
            busy.synchronize()  # (its last transfer read or filled it: done before reuse)
            self.busy[index] = None
        return index, self.buffers[index]

    def close(self) -> None:
        for busy in self.busy:
            if busy is not None:
                busy.synchronize()
        self.busy = [None, None]
        for buffer in self.buffers:
            buffer.close()
        self.buffers = []


def copy_staged(
    order: DeviceOrder,
    mark: tuple[Any, Any],
    staging: StagingBuffers,
    source: Memory,
    destination: Memory,
    size: int,
    pairs: Sequence[tuple[int, int]],
) -> Any:
    """A copy between a CUDA memory and a disk or pageable host memory through the two pinned
    buffers in turn: while one buffer's bytes cross the link, the other is filled or emptied.
    Returns the event of the last transfer onto the GPU (None: the bytes are off it already).
    The host waits for a buffer's previous transfer before using it again (so for the
    engine's work marked before the call, once more than two buffers' worth is copied)."""
    to_gpu = is_device(destination)
    ordered = [pair for run in runs(pairs, by_destination=not to_gpu) for pair in run]
    last = None
    with staging.lock:
        per_buffer = staging.fit(size)
        pending: tuple[Any, Bytes, Sequence[tuple[int, int]]] | None = None
        for chunk in _chunks(ordered, per_buffer):
            index, buffer = staging.next()
            rows = buffer.array[: len(chunk) * size]
            if to_gpu:  # the file or RAM -> this buffer, then this buffer -> GPU
                _fill(rows, source, chunk, size)
                moves = [(i, d) for i, (_, d) in enumerate(chunk)]
                last = order.issue(mark, batch(rows, destination, size, moves))
                staging.busy[index] = last
            else:  # GPU -> this buffer now; the other buffer -> the file or RAM meanwhile
                moves = [(s, i) for i, (s, _) in enumerate(chunk)]
                event = order.issue(mark, batch(source, rows, size, moves))
                staging.busy[index] = event
                if pending is not None:
                    _empty(*pending, destination, size)
                pending = (event, rows, chunk)
        if pending is not None:
            _empty(*pending, destination, size)
    return last


def _fill(rows: Bytes, source: Memory, chunk: Sequence[tuple[int, int]], size: int) -> None:
    """A buffer's rows from the chunk's source slots (in the chunk's order)."""
    at = 0
    array = host_array(source)
    for s, _, n in contiguous(chunk, 0):
        part = rows[at * size : (at + n) * size]
        if array is not None:
            part[:] = array[s * size : (s + n) * size]
        elif isinstance(source, DiskMemory):
            source.readv(s * size, [part])
        else:
            raise StorageError(22, f"no staged copy from {source.kind} memory")
        at += n


def _empty(
    event: Any, rows: Bytes, chunk: Sequence[tuple[int, int]], destination: Memory, size: int
) -> None:
    """A buffer's rows, once its transfer is done, into the chunk's destination slots."""
    event.synchronize()  # (the transfer into this buffer only)
    at = 0
    array = host_array(destination)
    for _, d, n in contiguous(chunk, 1):
        part = rows[at * size : (at + n) * size]
        if array is not None:
            array[d * size : (d + n) * size] = part
        elif isinstance(destination, DiskMemory):
            destination.writev(d * size, [part])
        else:
            raise StorageError(22, f"no staged copy to {destination.kind} memory")
        at += n


__all__ = [
    "DIRECT_PIECES",
    "GATHER_BYTES",
    "STAGING_BYTES",
    "StagingBuffers",
    "batch",
    "copy_staged",
    "host_array",
    "is_device",
    "pageable",
]
