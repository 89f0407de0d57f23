"""A `kvpool serve` daemon in its own process, and engines' clients of it, for the node tests
and the node benchmark: a small model layout, and pages written and read through the shared
memory the daemon hands out (as an engine's workers do)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from kvpool.layout import KVLayout
from kvpool.node import protocol as p
from kvpool.node.client import NodeClient
from kvpool.storage.shared import map_shared, shared_pool_file

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16
BUFFER = 512  # bytes of one K or V buffer of one block
LAYERS = [p.Layer(i, [("k", BUFFER), ("v", BUFFER)]) for i in range(2)]


def hello(model: str = "model-a", layers: list[p.Layer] | None = None) -> p.Hello:
    return p.Hello(p.VERSION, model, BLOCK, layers or LAYERS, 0, name=model)


def layout() -> KVLayout:
    from kvpool.config import AttentionLayerConfig, BufferConfig

    configs = [
        AttentionLayerConfig(layer.layer_id, [BufferConfig(n, s) for n, s in layer.buffers])
        for layer in LAYERS
    ]
    return KVLayout(configs, BLOCK)


def socket_dir() -> str:
    """A directory other users may enter (pytest's tmp_path is the user's own, 0700)."""
    path = tempfile.mkdtemp(prefix="kvpool-node-", dir="/tmp")
    os.chmod(path, 0o755)
    return path


def cpu_set(text: str) -> set[int]:
    """CPUs named as taskset lists them: "1", "1-3", "0,2"."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def pin(pid: int, cpus: str) -> None:
    """Every thread of process `pid` onto `cpus` (benchmarks: the daemon on a core of its own,
    as a node gives it one)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), cpu_set(cpus))


class Daemon:
    """`kvpool serve` as a process (the CLI, as systemd would start it)."""

    def __init__(self, sock: str, *flags: str) -> None:
        self.socket = sock
        self.flags = flags
        self.process: subprocess.Popen[str] | None = None
        self.log: list[str] = []  # what it wrote to standard error

    def start(self, timeout: float = 60) -> Daemon:
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvpool.cli", "serve", "--socket", self.socket, *self.flags],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        # (it says so once it listens; a killed daemon's socket file may still be there)
        assert self.process.stderr is not None
        seen = []
        for line in self.process.stderr:
            seen.append(line)
            if line.startswith("kvpool: serving on"):
                self.log = seen
                self._reader = threading.Thread(target=self._read, daemon=True)
                self._reader.start()  # (a full pipe would stop the daemon)
                return self
        raise RuntimeError(f"the daemon did not start: {''.join(seen)}")

    def _read(self) -> None:
        assert self.process is not None and self.process.stderr is not None
        for line in self.process.stderr:
            self.log.append(line)

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def terminate(self) -> tuple[int, str]:
        """SIGTERM: (exit status, what it logged)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(30)
        self._reader.join(10)
        return self.process.returncode, "".join(self.log)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def client(
    sock: str, model: str = "model-a", timeout_s: float = 1.0, poll_s: float | None = None
) -> NodeClient:
    polling = {} if poll_s is None else {"poll_s": poll_s}
    found = NodeClient(sock, hello(model), timeout_s=timeout_s, retry_s=(0.05, 0.2), **polling)
    assert found.connect(required=True), found.last_error
    return found


def pages(
    client: NodeClient, slots: list[int], group: int = 0
) -> list[tuple[object, int, int, int]]:
    """(the mapped pool, row, size) of every buffer of each slot, in order."""
    found = []
    shared = client.shared_memory()
    kv = layout()
    mapped: dict[str, object] = {}
    for slot in slots:
        for layer in LAYERS:
            for role, _ in layer.buffers:
                place = kv.placement(layer.layer_id, role)
                name = shared_pool_file(place.pool_group, place.pool)
                if name not in mapped:
                    mapped[name] = map_shared(shared[name])
                row = slot * place.buffers_per_slot + place.position
                found.append((mapped[name], row * place.size, place.size, slot))
    return found


def write_blocks(client: NodeClient, slots: list[int], first_value: int) -> None:
    """Block i's every buffer filled with byte (first_value + i) % 256."""
    per_block = sum(len(layer.buffers) for layer in LAYERS)
    for n, (pool, start, size, _) in enumerate(pages(client, slots)):
        pool[start : start + size] = (first_value + n // per_block) % 256  # type: ignore[index]


def read_blocks(client: NodeClient, slots: list[int]) -> list[set[int]]:
    """Per block, the set of byte values its buffers hold."""
    per_block = sum(len(layer.buffers) for layer in LAYERS)
    found: list[set[int]] = [set() for _ in slots]
    for n, (pool, start, size, _) in enumerate(pages(client, slots)):
        found[n // per_block] |= set(pool[start : start + size].tolist())  # type: ignore[index]
    return found
