"""A recording stand-in for torch.cuda, so the manager's CUDA paths run on the CPU.

With `install(monkeypatch)`, a GPU level is "CUDA memory" backed by a CPU torch tensor, and
`kvpool.storage.device.cuda()` returns a `FakeCuda`: streams and events that do nothing but
append to `log`, so a test sees the order in which kvpool records events, makes streams wait and
launches its copies (`launches` counts the tensor operations of each copy), and a cudart whose
host registrations are recorded (or refused, to test the fallback). The copies themselves are
real (CPU) torch copies: bytes can be checked after every move.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import torch


class FakeStream:
    def __init__(self, cuda: FakeCuda, name: str) -> None:
        self.cuda, self.name = cuda, name

    def wait_event(self, event: FakeEvent) -> None:
        self.cuda.log.append(("wait", self.name, event.name))

    def synchronize(self) -> None:
        self.cuda.log.append(("stream synchronize", self.name))

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
            return 1  # cudaErrorInvalidValue
        self.cuda.registered[address] = nbytes
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        self.cuda.log.append(("unregister", address))
        del self.cuda.registered[address]
        return 0


class FakeCuda:
    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.numbers = itertools.count()
        self.streams = itertools.count()
        self.registered: dict[int, int] = {}
        self.refuse_pinning = False
        self.engine = FakeStream(self, "engine")
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

    def ops(self, *kinds: str) -> list[tuple[Any, ...]]:
        return [entry for entry in self.log if entry[0] in kinds]


def install(monkeypatch: Any) -> FakeCuda:
    """GPU levels become CPU tensors under a recording torch.cuda (until the test ends)."""
    from kvpool.storage import device, memory

    fake = FakeCuda()
    monkeypatch.setattr(device, "cuda", lambda: fake)
    monkeypatch.setattr(memory, "cuda_available", lambda: True)
    monkeypatch.setattr(memory, "_cuda_bytes", lambda size: torch.zeros(size, dtype=torch.uint8))
    for name in ("copy_", "index_copy_", "index_select"):
        real = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: Any, _real: Any = real, _name: str = name,
                    **kwargs: Any) -> Any:  # fmt: skip
            stream = fake.current_stream()
            if stream is not fake.engine:  # (kvpool's copies, not the test's own)
                fake.log.append(("launch", stream.name, _name))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return fake
