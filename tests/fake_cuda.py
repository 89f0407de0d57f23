"""A recording stand-in for torch.cuda, so the manager's CUDA paths run on the CPU.

With `install(monkeypatch)`, a GPU level is "CUDA memory" backed by a CPU torch tensor, and
`kvpool.storage.device.cuda()` returns a `FakeCuda`: streams and events that do nothing but
append to `log`, so a test sees the order in which kvpool records events, makes streams wait and
launches its copies (`launches` counts the tensor operations of each copy, with the bytes each
moved), and a cudart whose host registrations are recorded (or refused, to test the fallback).
The copies themselves are real (CPU) torch copies: bytes can be checked after every move.

What the stand-in also models, to catch what would go wrong on a GPU:
- A refused `cudaHostRegister` (or `cudaHostUnregister`) leaves a pending error in the calling
  thread, which the next tensor operation in that thread raises, as a checked kernel launch
  does; `runtime().cudaGetLastError()` clears it.
- Every copy between host memory (kvpool's mappings) and "device" memory is logged as a
  `transfer` saying whether its host side lies in one registered range (pinned) or not.
- `pin_memory()`, `.to(..., non_blocking=)` on a copy stream, and `record_stream` are logged.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


class FakeStream:
    def __init__(self, cuda: FakeCuda, name: str) -> None:
        self.cuda, self.name = cuda, name

    def wait_event(self, event: FakeEvent) -> None:
        self.cuda.log.append(("wait", self.name, event.name))

    def synchronize(self) -> None:
        self.cuda.log.append(("stream synchronize", self.name))

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class FakeEvent:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.name = f"event{next(cuda.numbers)}"
        self.recorded_on: str | None = None
        self.done = False  # (pending until the host waits for it, as a slow GPU's would be)

    def record(self, stream: FakeStream) -> None:
        self.recorded_on = stream.name
        self.cuda.log.append(("record", stream.name, self.name))

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.cuda.log.append(("event synchronize", self.name))
        self.done = True


class FakeCudart:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        self.cuda.log.append(("register", address, nbytes))
        if self.cuda.refuse_pinning:
            return self.cuda.fail(1)  # cudaErrorInvalidValue
        self.cuda.registered[address] = nbytes
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        self.cuda.log.append(("unregister", address))
        if address not in self.cuda.registered:
            return self.cuda.fail(713)  # cudaErrorHostMemoryNotRegistered
        del self.cuda.registered[address]
        if self.cuda.refuse_unregistering:
            return self.cuda.fail(1)
        return 0


class FakeRuntime:
    """libcudart as `kvpool.storage.device.runtime()` finds it: the thread's last error."""

    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda

    def cudaGetLastError(self) -> int:
        self.cuda.log.append(("get last error",))
        return self.cuda.pending.pop(threading.get_ident(), 0)


class FakeCuda:
    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.numbers = itertools.count()
        self.streams = itertools.count()
        self.registered: dict[int, int] = {}
        self.refuse_pinning = False
        self.refuse_unregistering = False
        self.pending: dict[int, int] = {}  # thread id -> its last error, not yet cleared
        self.host_ranges: list[tuple[int, int]] = []  # kvpool's host mappings (address, bytes)
        self.engine = FakeStream(self, "engine")
        self.runtime = FakeRuntime(self)
        self._current = threading.local()

    def Stream(self) -> FakeStream:  # (torch.cuda's names)
        return FakeStream(self, f"copy{next(self.streams)}")

    def Event(self) -> FakeEvent:
        return FakeEvent(self)

    def current_stream(self) -> FakeStream:
        return getattr(self._current, "stream", None) or self.engine

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        before = getattr(self._current, "stream", None)
        self._current.stream = stream
        self.log.append(("enter", stream.name))
        try:
            yield
        finally:
            self.log.append(("exit", stream.name))
            self._current.stream = before

    def synchronize(self) -> None:
        self.log.append(("device synchronize",))

    def cudart(self) -> FakeCudart:
        return FakeCudart(self)

    def fail(self, code: int) -> int:
        """A refused runtime call: its error stays pending in the calling thread."""
        self.pending[threading.get_ident()] = code
        return code

    def ops(self, *kinds: str) -> list[tuple[Any, ...]]:
        return [entry for entry in self.log if entry[0] in kinds]

    def side(self, tensor: torch.Tensor) -> str:
        """Where a tensor's bytes are: 'pinned' or 'pageable' host memory, or 'device'."""
        if getattr(tensor, "_fake_pinned", False):
            return "pinned"
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        if not any(a <= start and end <= a + n for a, n in self.host_ranges):
            return "device"
        registered = any(a <= start and end <= a + n for a, n in self.registered.items())
        return "pinned" if registered else "pageable"


def install(monkeypatch: Any) -> FakeCuda:
    """GPU levels become CPU tensors under a recording torch.cuda (until the test ends)."""
    from kvpool.storage import device, device_memory, memory

    fake = FakeCuda()
    monkeypatch.setattr(device, "cuda", lambda: fake)
    monkeypatch.setattr(device, "runtime", lambda: fake.runtime)
    monkeypatch.setattr(device_memory, "cuda_available", lambda: True)
    monkeypatch.setattr(
        device_memory, "_cuda_bytes", lambda size: torch.zeros(size, dtype=torch.uint8)
    )
    real_reserve = memory._reserve

    def reserve(size: int) -> mmap.mmap:
        mapped = real_reserve(size)
        fake.host_ranges.append((np.frombuffer(mapped, dtype=np.uint8).ctypes.data, len(mapped)))
        return mapped

    monkeypatch.setattr(memory, "_reserve", reserve)
    for name in ("copy_", "index_copy_", "index_select"):
        real = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: Any, _real: Any = real, _name: str = name,
                    **kwargs: Any) -> Any:  # fmt: skip
            code = fake.pending.pop(threading.get_ident(), 0)
            if code:  # (a checked launch reports the thread's pending error as its own)
                raise RuntimeError(f"CUDA error: {code} (pending in this thread)")
            stream = fake.current_stream()
            result = _real(self, *args, **kwargs)
            if stream is not fake.engine:  # (kvpool's copies, not the test's own)
                moved = {"copy_": self, "index_copy_": args[2] if len(args) > 2 else self}
                out = moved.get(_name, result)
                fake.log.append(("launch", stream.name, _name, out.numel() * out.element_size()))
                if _name == "copy_":
                    sides = (fake.side(args[0]), fake.side(self))
                    if "device" in sides and sides != ("device", "device"):
                        direction = "to-gpu" if sides[1] == "device" else "to-host"
                        host = sides[0] if direction == "to-gpu" else sides[1]
                        fake.log.append(("transfer", stream.name, direction, host))
            return result

        monkeypatch.setattr(torch.Tensor, name, counted)

    def pin_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        pinned = self.clone()
        pinned._fake_pinned = True  # type: ignore[attr-defined]
        fake.log.append(("pin_memory", fake.current_stream().name))
        return pinned

    real_to = torch.Tensor.to

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        stream = fake.current_stream()
        if stream is not fake.engine:
            blocking = not kwargs.get("non_blocking", False)
            fake.log.append(("to", stream.name, "blocking" if blocking else "non-blocking",
                             fake.side(self)))  # fmt: skip
        return real_to(self, *args, **kwargs)

    def record_stream(self: torch.Tensor, stream: FakeStream) -> None:
        fake.log.append(("record_stream", stream.name, self.numel()))

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    return fake
