"""How kvpool's copies of CUDA memory are ordered with the engine's work, and how host memory is
pinned for them.

The contract (the engine guide states it for users):
- kvpool copies on a CUDA stream of its own (one per manager: `DeviceOrder.copy_stream`).
- A copy first waits (on the device, not the host) for an event recorded on the engine's stream
  when the kvpool call was made: every kernel the engine launched before the call, such as the
  attention that wrote the pages a `suspend()` now copies out, is done before the copy reads.
- When a copy is issued, the engine's stream is made to wait for its completion event: the
  engine's next kernels read pages a `resume()` brought back, and write into slots a copy has
  just read, only after the copy. The host does not wait for either.
- The host waits on a copy's own event (never on the device) only before the CPU touches the
  bytes the copy wrote or read: a CPU copy out of host memory a GPU copy fills, a disk write of
  it, reading a page's bytes, handing its host slot to a CPU writer.
The engine's stream is the stream current in the calling thread at each call, or the one set
with `KVCacheManager.set_engine_stream`.

`cuda()` is the one place the torch.cuda module is taken from, so tests can stand a recording
double in for it and run the device paths on the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
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

    def issue(self, mark: tuple[Any, Any], work: Callable[[], None]) -> Any:
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


_pin_refused: list[str] = []  # (the first refusal's reason: logged once per process)


def pin(address: int, nbytes: int) -> bool:
    """Page-lock (register with the CUDA driver) `nbytes` of host memory at `address`, so copies
    between it and the GPU are asynchronous DMA at the link's bandwidth. False (and one log
    line per process) where the driver refuses; the memory still works, pageable."""
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
    if not _pin_refused:
        _pin_refused.append(reason)
        logger.warning(
            "host memory could not be pinned (%s): copies to and from the GPU use pageable "
            "memory, synchronous and slower",
            reason,
        )
    return False


def unpin(address: int) -> None:
    """Undo `pin` (before the memory is unmapped, remapped or handed back)."""
    try:
        cuda().cudart().cudaHostUnregister(address)
    except Exception as error:  # (the memory is released either way)
        logger.warning("cudaHostUnregister failed: %s", error)


__all__ = ["DeviceOrder", "cuda", "pin", "unpin"]
