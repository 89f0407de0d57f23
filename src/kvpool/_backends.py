"""Which implementation of the core runs: `native` or `python`.

The native backend is the core's modules (`_native_modules.NATIVE_MODULES`) compiled to C
extension modules by mypyc when kvpool is installed; the python backend is the same modules run
as source, the reference. Both are one source, so they take the same decisions; the suite and
the differential fuzzer check that they do.

`KVPOOL_BACKEND=native|python` selects (default `native`). Chosen once, when `kvpool` is first
imported, before any module of the core: with `python` (asked for, or a fallback) an import hook
loads those modules from their `.py` files even where compiled ones sit next to them. The native
backend falls back to python, with one log line saying why, when it was not built (no compiler
at install), when its sources changed since it was built (an edited checkout: rebuild with
`pip install -e .`), or when its modules fail to import.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from kvpool._native_modules import C_MODULES, NATIVE_MODULES, STAMP, stamped_sources
from kvpool.errors import ConfigError

ENV = "KVPOOL_BACKEND"
CHOICES = ("native", "python")
PACKAGE_DIR = Path(__file__).resolve().parent
_log = logging.getLogger("kvpool")


def module_name(path: str) -> str:
    """`tiers/__init__.py` -> `kvpool.tiers`, `cache/state.py` -> `kvpool.cache.state`."""
    parts = path.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["kvpool", *parts])


COMPILED = (*NATIVE_MODULES, *C_MODULES)  # each has a compiled module beside its source
NATIVE_NAMES = frozenset(module_name(path) for path in COMPILED)


def sources_digest(package_dir: Path = PACKAGE_DIR) -> str:
    """The digest of the compiled modules' sources (what the build stamps)."""
    digest = hashlib.sha256()
    for path in stamped_sources():
        digest.update(path.encode() + b"\0" + (package_dir / path).read_bytes() + b"\0")
    return digest.hexdigest()


@dataclass(frozen=True)
class BackendInfo:
    """The backend that runs, the one asked for, and why they differ (empty when they don't)."""

    name: str
    requested: str
    reason: str = ""

    def describe(self) -> str:
        """`native`, `python`, or `python (the native backend is not built (...))`."""
        return (
            self.name if not self.reason else f"{self.name} (the native backend is {self.reason})"
        )


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Finds the core's modules as source files, never as the compiled modules beside them."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in NATIVE_NAMES:
            return None
        base = fullname.rpartition(".")[2]
        for entry in path or ():
            package = os.path.join(entry, base)
            if os.path.isfile(os.path.join(package, "__init__.py")):
                return importlib.util.spec_from_file_location(
                    fullname,
                    os.path.join(package, "__init__.py"),
                    submodule_search_locations=[package],
                )
            if os.path.isfile(package + ".py"):
                return importlib.util.spec_from_file_location(fullname, package + ".py")
        return None


_info: BackendInfo | None = None


def _compiled_file(path: str) -> Path | None:
    stem = PACKAGE_DIR / path.removesuffix(".py")
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if stem.with_name(stem.name + suffix).is_file():
            return stem.with_name(stem.name + suffix)
    return None


def _why_not_native() -> str:
    """Why the native backend cannot run here ("" when it can)."""
    missing = [path for path in COMPILED if _compiled_file(path) is None]
    if len(missing) == len(COMPILED):
        return "not built (no compiled modules: installed without a C compiler or mypyc?)"
    if missing:
        return f"partly built ({len(missing)} compiled modules missing, e.g. {missing[0]})"
    stamp = PACKAGE_DIR / STAMP
    if not stamp.is_file():
        return f"not built: its last build did not finish (no {STAMP} beside the compiled modules)"
    if stamp.read_text().strip() != sources_digest():
        return "stale: the sources changed since it was built (rebuild: pip install -e .)"
    try:
        importlib.import_module("kvpool.records")
    except ImportError as error:
        keep = {"kvpool", __name__, "kvpool._native_modules", "kvpool.errors"}
        for name in [name for name in sys.modules if name.startswith("kvpool.")]:
            if name not in keep:
                del sys.modules[name]
        return f"its modules fail to import ({error})"
    return ""


def select() -> BackendInfo:
    """Chooses the backend (once; later calls return the first choice)."""
    global _info
    if _info is not None:
        return _info
    requested = os.environ.get(ENV, "").strip().lower()
    if requested not in ("", *CHOICES):
        raise ConfigError(
            f"{ENV}={os.environ[ENV]!r}: not a backend (choose one of {', '.join(CHOICES)})"
        )
    reason = "" if requested == "python" else _why_not_native()
    if requested == "python" or reason:  # (before any module of the core is imported)
        sys.meta_path.insert(0, _SourceFinder())
        _info = BackendInfo("python", requested or "native", reason)
        if reason:
            _log.warning("kvpool: running the python backend: the native backend is %s", reason)
    else:
        _info = BackendInfo("native", requested or "native")
    return _info
