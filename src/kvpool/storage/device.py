"""How kvpool's copies of CUDA memory are ordered with the engine's work, and how host memory is
pinned for them.

The contract (the engine guide states it for users):
- kvpool copies on a CUDA stream of its own (one per manager: `DeviceOrder.copy_stream`).
- A copy first waits (on the device, not the host) for an event recorded on the engine's stream
  when the kvpool call was made: every kernel the engine launched before the call, such as the
  attention that wrote the pages a `suspend()` now copies out, is done before the copy reads.
- When a copy is issued, the engine's stream is made to wait for its completion event: the
  engine's next kernels read pages a `resume()` brought back, and write into slots a copy has
  just read, only after the copy. The host does not wait for either: index tensors go to the
  GPU from pinned memory without blocking (pageable memory would make the host wait for the
  copy stream, and so for the engine's earlier kernels).
- The host waits on a copy's own event (never on the device) only before the CPU touches the
  bytes the copy wrote or read: a CPU copy out of host memory a GPU copy fills, a disk write of
  it, reading a page's bytes, handing its host slot to a CPU writer; and on the whole copy
  stream (`drain`) only before memory a copy may still use is unregistered, remapped, handed
  back or freed (a resize of a level, `shutdown`).
- The GPU memory of a level is reallocated, read and written on the copy stream too, after
  the engine's marked work; a tensor dropped there is recorded on the streams that used it
  (`retire`), so the caching allocator hands its memory out again only after their work.
The engine's stream is the stream current in the calling thread at each call, or the one set
with `KVCacheManager.set_engine_stream`.

A refused CUDA runtime call (a `cudaHostRegister` the driver or a sandbox refuses) leaves the
calling thread's "last error" set, which the next checked kernel launch in that thread would
report as its own: `pin` and `unpin` clear it (`clear_error`) before going on.

`cuda()` and `runtime()` are the places the torch.cuda module and the CUDA runtime library are
taken from, so tests can stand recording doubles in for them and run the device paths on the
CPU.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger("kvpool.storage")


def cuda() -> Any:
    """The torch.cuda module (imported on first use)."""
    import torch

    return torch.cuda


class DeviceOrder:
    """The copy stream of one manager and the engine stream its copies are ordered with."""

    def __init__(self) -> None:
        self._cuda = cuda()
        self.copy_stream: Any = self._cuda.Stream()
        self.engine_stream: Any = None  # None: the stream current in the calling thread

    def engine(self) -> Any:
        """The engine's stream for a call made now (in the calling thread)."""
        return self.engine_stream if self.engine_stream is not None else self._cuda.current_stream()

    def mark(self) -> tuple[Any, Any]:
        """In the calling (engine's) thread, before a copy: (the engine's stream, an event
        recorded on it now). Recorded at the call, not when a worker thread runs the copy."""
        stream = self.engine()
        event = self._cuda.Event()
        event.record(stream)
        return stream, event

    def issue(self, mark: tuple[Any, Any], work: Callable[[], object]) -> Any:
        """Run `work` (which enqueues the copies) on the copy stream after the marked engine
        work; make the engine's stream wait for it; return its completion event."""
        engine, after = mark
        stream = self.copy_stream
        stream.wait_event(after)
        with self._cuda.stream(stream):
            work()
        done = self._cuda.Event()
        done.record(stream)
        engine.wait_event(done)
        return done

    def drain(self) -> None:
        """Wait (on the host) for every copy issued so far: before memory a copy may still
        read or write is unregistered, remapped, handed back or freed."""
        self.copy_stream.synchronize()

    def retire(self, tensor: Any) -> None:
        """Before a CUDA tensor the copies and the engine used is dropped: the caching
        allocator is told of both streams' work on it, so it hands the memory out again only
        after that work is done (`record_stream`; its own allocation stream needs nothing)."""
        tensor.record_stream(self.copy_stream)
        tensor.record_stream(self.engine())


def index_tensor(values: Sequence[int] | Sequence[Sequence[int]], device: Any) -> Any:
    """An int64 tensor of `values` on `device`, sent from pinned memory without blocking (in
    kvpool's copy code: on the copy stream, which the host must not wait for)."""
    import torch

    return pinned(torch.tensor(values, dtype=torch.int64)).to(device, non_blocking=True)


_pinned_refused: list[str] = []  # (the first refusal of pinned host tensors: logged once)


def pinned(tensor: Any) -> Any:
    """A copy of a host `tensor` in pinned memory (torch's caching host allocator, which keeps
    it until the non-blocking copies that read it are done); the tensor itself, pageable, where
    pinned memory cannot be had (one log line per process)."""
    try:
        return tensor.pin_memory()
    except RuntimeError as error:
        clear_error()
        if not _pinned_refused:
            _pinned_refused.append(str(error))
            logger.warning("no pinned host memory (%s): index copies block the host", error)
        return tensor


def loaded_library(prefix: str, maps: str = "/proc/self/maps") -> str | None:
    """The path of a shared library this process has loaded whose file name starts with
    `prefix` (None if there is none, or no /proc)."""
    try:
        with open(maps) as lines:
            for line in lines:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith(prefix):
                    return fields[5].strip()
    except OSError:
        pass
    return None


_runtime: list[Any] = []  # (the library, or None, found on first use)


def runtime() -> Any:
    """The CUDA runtime library torch uses (libcudart, loaded again through ctypes: the same
    instance, so the same per-thread last error), or None where torch links it statically."""
    if not _runtime:
        path, library = loaded_library("libcudart.so"), None
        if path is not None:
            try:
                library = ctypes.CDLL(path)
                library.cudaGetLastError.restype = ctypes.c_int
            except (OSError, AttributeError):
                library = None
        _runtime.append(library)
    return _runtime[0]


def clear_error() -> int:
    """Reset the calling thread's last CUDA error (a refused runtime call leaves it set, and the
    next checked kernel launch in this thread would report it). Returns the code cleared."""
    library = runtime()
    if library is not None:
        return int(library.cudaGetLastError())
    try:  # (a static runtime: a checked launch reports the pending error, and so clears it)
        import torch

        torch.zeros(1, device="cuda").add_(1)
    except RuntimeError:
        return -1
    return 0


_pin_refused: list[str] = []  # (the first refusal's reason: logged once per process)


def pin(address: int, nbytes: int) -> bool:
    """Page-lock (register with the CUDA driver) `nbytes` of host memory at `address`, so copies
    between it and the GPU are asynchronous DMA at the link's bandwidth. False (and one log
    line per process) where the driver refuses, with the thread's CUDA error cleared; the
    memory still works, pageable."""
    if nbytes <= 0:
        return False
    try:
        result = cuda().cudart().cudaHostRegister(address, nbytes, 0)
        code = int(getattr(result, "value", result) or 0)
    except Exception as error:  # no cudart binding, a driver that is missing or refuses
        code, reason = -1, f"{type(error).__name__}: {error}"
    else:
        reason = f"cudaHostRegister returned {code}"
    if code == 0:
        return True
    clear_error()
    if not _pin_refused:
        _pin_refused.append(reason)
        logger.warning(
            "host memory could not be pinned (%s): copies to and from the GPU use pageable "
            "memory, synchronous and slower",
            reason,
        )
    return False


def unpin(address: int) -> bool:
    """Undo `pin` (after `DeviceOrder.drain`, before the memory is unmapped, remapped or handed
    back). False, with a log line and the thread's CUDA error cleared, where it fails."""
    try:
        result = cuda().cudart().cudaHostUnregister(address)
        code = int(getattr(result, "value", result) or 0)
    except Exception as error:  # (the memory is released either way)
        code, reason = -1, f"{type(error).__name__}: {error}"
    else:
        reason = f"returned {code}"
    if code == 0:
        return True
    clear_error()
    logger.warning("cudaHostUnregister of %#x failed (%s)", address, reason)
    return False


__all__ = [
    "DeviceOrder",
    "clear_error",
    "cuda",
    "index_tensor",
    "loaded_library",
    "pin",
    "pinned",
    "runtime",
    "unpin",
]
