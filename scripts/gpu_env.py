"""What `scripts/gpu_check.sh` runs on, one summary line per fact: the Python and the backend
kvpool runs on there, the packages the checks import, the GPU, and whether host memory can be
pinned (and, where the driver refuses, that its error does not fail the next kernel).

Run from the work tree with `src` on the path: python3 scripts/gpu_env.py [OUT]
Exit status: 0 with a CUDA device, 3 without one (the CUDA checks are skipped), 1 when a package
the checks need is missing (carry it as a wheel in .whl/: see the device tool's README).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import sys
from pathlib import Path

REQUIRED = ("numpy", "pytest", "torch", "mypy_extensions")  # (kvpool's and the checks' imports)
OPTIONAL = ("transformers", "hypothesis")
NO_CUDA = 3


def say(line: str) -> None:
    print(f"gpu_check: {line}", flush=True)


def version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        try:
            module = importlib.import_module(name)
        except ImportError:
            return None
        return str(getattr(module, "__version__", "?"))


def packages() -> list[str]:
    """The packages line; the names of the required ones that are missing."""
    found = {name: version(name) for name in (*REQUIRED, *OPTIONAL)}
    missing = [name for name in REQUIRED if found[name] is None]
    shown = [f"{name} {found[name] or 'MISSING'}" for name in (*REQUIRED, *OPTIONAL)]
    note = ""
    if found["transformers"] is not None:
        try:
            importlib.import_module("kvpool.integrations.transformers")
        except ImportError as error:  # (an older transformers than the integration supports)
            note = f"; the transformers integration's tests skip: {error}"
        except Exception as error:
            note = f"; the transformers integration fails to import: {error!r}"
    say(f"packages: {', '.join(shown)}{note}")
    return missing


def backend() -> None:
    """Where kvpool comes from and which backend runs; compiled modules built for another
    Python (the checkout's cp311 ones on a device with 3.12) are named: they cannot load."""
    import kvpool

    where = Path(kvpool.__file__).resolve().parent
    line = f"kvpool: {where}, backend {kvpool.backend_info().describe()}"
    tag = sys.implementation.cache_tag  # e.g. cpython-312
    built = {re.search(r"cpython-\d+", p.name) for p in where.rglob("*.cpython-*.so")}
    others = sorted({found.group() for found in built if found} - {tag})
    if others and kvpool.backend() == "python":
        line += f"; compiled modules here are for {', '.join(others)}, not this {tag}"
    say(line)


def gpu() -> bool:
    import torch

    cuda = torch.version.cuda
    if not torch.cuda.is_available():
        say(f"gpu: skipped: no CUDA device (torch {torch.__version__} sees none)")
        return False
    props = torch.cuda.get_device_properties(0)
    say(
        f"gpu: {props.name}, {props.total_memory >> 20} MiB, {props.multi_processor_count} SMs; "
        f"torch {torch.__version__}, CUDA {cuda}"
    )
    return True


def pinning() -> bool:
    """Pin 4 MiB the way host levels are pinned, then launch a kernel in this thread."""
    import torch

    from kvpool.storage import device
    from kvpool.storage.memory import HostMemory

    memory = HostMemory(4 << 20)
    pinned = memory.pin()
    runtime = device.runtime()
    found = f"libcudart through ctypes: {runtime._name}" if runtime is not None else "no libcudart"
    try:
        values = torch.ones(256, device="cuda")
        values.add_(1)
        torch.cuda.synchronize()
        launched = "the next kernel ran"
    except RuntimeError as error:
        launched = f"the next kernel FAILED: {error}"
    memory.close()
    if pinned:
        say(f"pinning: cudaHostRegister works; {launched} ({found})")
    else:
        reason = device._pin_refused[0] if device._pin_refused else "?"
        say(
            f"pinning: refused by the driver ({reason}): host levels stay pageable, copies "
            f"synchronous; the error was cleared, {launched} ({found})"
        )
    return "FAILED" not in launched


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    say(f"python: {sys.version.split()[0]} at {sys.executable}")
    missing = packages()
    if not {"numpy", "mypy_extensions"} & set(missing):
        backend()
    if missing:
        say(
            f"MISSING {', '.join(missing)}: carry them as wheels in .whl/ (the device tool's README)"
        )
        return 1
    if not gpu():
        say("pinning: skipped: no CUDA device")
        return NO_CUDA
    ok = pinning()
    if out is not None:
        import torch

        (out / "gpu.txt").write_text(
            f"{torch.cuda.get_device_name(0)}\ntorch {torch.__version__}\n"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
