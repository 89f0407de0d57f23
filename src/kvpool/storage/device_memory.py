"""The GPU level's memory: a torch CUDA byte tensor when a GPU is present, else host memory with
the same interface.

CUDA memory is reallocated on resize, so its addresses move (re-fetch views), and a resize
briefly needs the old and the new size at once, plus a device copy of what is kept (at the
device's memory bandwidth: about a millisecond per GiB on an H200). With the copier's
`DeviceOrder` (`order`, set when the manager is made) a resize, `read` and `write` run on the
copy stream, after the copies issued before and the engine's work queued before the call,
and the engine's stream waits for them; the tensor a resize or `close` drops is recorded on
both streams (`DeviceOrder.retire`), so the caching allocator does not hand its memory out
while a copy or a kernel may still use it.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import sys
from typing import Any

import numpy as np

from kvpool.errors import StorageError
from kvpool.storage.device import DeviceOrder, pinned
from kvpool.storage.memory import Bytes, HostMemory, Memory, _check_size

CUDA_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd")  # NVIDIA's driver, AMD's (ROCm)


def cuda_available() -> bool:
    """True when torch is installed and sees a CUDA (or ROCm) device. Torch is imported only
    when it is imported already or a GPU driver's device file exists: importing it costs
    seconds and hundreds of MiB, which a machine without a GPU should not pay."""
    if "torch" not in sys.modules:
        if importlib.util.find_spec("torch") is None:
            return False
        if not any(os.path.exists(path) for path in CUDA_DEVICE_FILES):
            return False
    import torch

    return bool(torch.cuda.is_available())


def _cuda_bytes(size: int) -> Any:
    """An uninitialized CUDA byte tensor; `StorageError` (ENOMEM) when the device is full."""
    import torch

    try:
        return torch.empty(size, dtype=torch.uint8, device="cuda")
    except RuntimeError as error:  # torch.OutOfMemoryError is one
        free, total = torch.cuda.mem_get_info()
        raise StorageError(
            errno.ENOMEM,
            f"cannot allocate {size} bytes ({size / 2**30:.1f} GiB) of CUDA memory: "
            f"{free} bytes free of {total}",
        ) from error


class DeviceMemory(Memory):
    """Accelerator memory: a torch CUDA byte tensor, or `HostMemory` when there is no GPU."""

    def __init__(self, size: int, max_size: int | None = None) -> None:
        _check_size("size", size)
        self._host: HostMemory | None = None
        self._tensor: Any = None
        self.order: DeviceOrder | None = None
        """The copy stream and engine stream its resizes, reads and writes are ordered with
        (set by the copier; None: the caller's current stream, as before any copy)."""
        if cuda_available():
            self.kind = "cuda"
            self._tensor = _cuda_bytes(size)
        else:
            self.kind = "host (no CUDA device)"
            self._host = HostMemory(size, max_size)

    @property
    def is_cuda(self) -> bool:
        return self._host is None

    @property
    def host(self) -> HostMemory:
        """The host memory standing in for the device (only when there is no GPU)."""
        if self._host is None:
            raise StorageError(errno.EINVAL, "device memory is CUDA memory, not host memory")
        return self._host

    @property
    def tensor(self) -> Any:
        """The CUDA byte tensor (only with a GPU; its address changes on resize)."""
        if self._host is not None:
            raise StorageError(errno.EINVAL, "device memory is host memory (no CUDA device)")
        return self._tensor

    @property
    def size(self) -> int:
        if self._host is not None:
            return self._host.size
        return 0 if self._tensor is None else int(self._tensor.numel())

    def resize(self, new_size: int) -> None:
        _check_size("new_size", new_size)
        if self._host is not None:
            self._host.resize(new_size)
            return
        old = self._tensor
        keep = min(new_size, int(old.numel()))
        fresh = _cuda_bytes(new_size)
        order = self.order
        if order is None:
            fresh[:keep].copy_(old[:keep])
        else:  # after the copies and the engine's work on the old memory; the engine after it
            order.issue(order.mark(), lambda: fresh[:keep].copy_(old[:keep], non_blocking=True))
            order.retire(old)
        self._tensor = fresh

    def read(self, offset: int, nbytes: int) -> Bytes:
        if self._host is not None:
            return self._host.read(offset, nbytes)
        self._check_range(offset, nbytes)
        part = self._tensor[offset : offset + nbytes]
        if self.order is None:
            result: Bytes = part.cpu().numpy()
            return result
        import torch

        out = torch.empty(nbytes, dtype=torch.uint8)
        # (A blocking copy on the copy stream: the host waits for it, as it must to read.)
        self.order.issue(self.order.mark(), lambda: out.copy_(part))
        copied: Bytes = out.numpy()
        return copied

    def write(self, offset: int, data: Bytes | bytes) -> None:
        if self._host is not None:
            self._host.write(offset, data)
            return
        import torch

        source = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
        self._check_range(offset, source.size)
        part = self._tensor[offset : offset + source.size]
        if self.order is None:
            part.copy_(torch.from_numpy(source.copy()))
            return
        # Its own copy, pinned where it can be (kept until the copy is done: torch's caching
        # host allocator waits for the copy's event before reusing it).
        staged = pinned(torch.from_numpy(source.copy()))
        self.order.issue(self.order.mark(), lambda: part.copy_(staged, non_blocking=True))

    def close(self) -> None:
        if self._host is not None:
            self._host.close()
        if self._tensor is not None and self.order is not None:
            self.order.retire(self._tensor)
        self._tensor = None


__all__ = ["CUDA_DEVICE_FILES", "DeviceMemory", "cuda_available"]
