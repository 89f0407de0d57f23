"""Builds the native backend: the core's modules (src/kvpool/_native_modules.py) compiled by
mypyc. Best effort: if mypyc or the C compiler fails, kvpool installs without it and runs its
python backend (`kvpool info` says which backend runs, and why). KVPOOL_BUILD_NATIVE=0 skips it.
"""

from __future__ import annotations

import hashlib
import os
import sys
import traceback
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
PACKAGE = ROOT / "src" / "kvpool"


def native_modules() -> tuple[list[str], str]:
    namespace: dict[str, object] = {}
    exec((PACKAGE / "_native_modules.py").read_text(), namespace)
    return list(namespace["NATIVE_MODULES"]), str(namespace["STAMP"])  # type: ignore[call-overload]


def sources_digest(modules: list[str]) -> str:
    # (the same digest as kvpool._backends.sources_digest, which checks it at import)
    digest = hashlib.sha256()
    for path in modules:
        digest.update(path.encode() + b"\0" + (PACKAGE / path).read_bytes() + b"\0")
    return digest.hexdigest()


def say(message: str) -> None:
    print(f"kvpool setup: {message}", file=sys.stderr, flush=True)


class BuildNative(build_ext):
    """build_ext that never fails the install: a module that does not build leaves the native
    backend unbuilt, and the stamp (written only after every module built) is then absent."""

    def run(self) -> None:
        if not self.extensions:
            return
        modules, stamp = native_modules()
        package_dir = Path(self.get_ext_fullpath("kvpool.records")).parent
        (package_dir / stamp).unlink(missing_ok=True)
        try:
            super().run()
        except Exception:  # a missing compiler, a compile error: install the python backend
            traceback.print_exc()
            say("the native backend did not build; kvpool will run its python backend")
            return
        package_dir.mkdir(parents=True, exist_ok=True)
        (package_dir / stamp).write_text(sources_digest(modules) + "\n")
        say(f"native backend built ({len(modules)} modules)")


# The commands that build extensions (pip calls setup.py for metadata first: no mypyc there).
BUILDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install"}


def up_to_date(modules: list[str], stamp: str) -> bool:
    """Whether the checkout's compiled modules match its sources (an editable reinstall)."""
    stamped = PACKAGE / stamp
    return (
        stamped.is_file()
        and stamped.read_text().strip() == sources_digest(modules)
        and all(list(PACKAGE.glob(path.removesuffix(".py") + ".*.so")) for path in modules)
    )


def extensions() -> list[object]:
    if not BUILDS & set(sys.argv[1:]):
        return []
    if os.environ.get("KVPOOL_BUILD_NATIVE", "1") == "0":
        say("KVPOOL_BUILD_NATIVE=0: not building the native backend")
        return []
    modules, stamp = native_modules()
    if "editable_wheel" in sys.argv and up_to_date(modules, stamp):
        say("the native backend in the checkout is up to date")
        return []
    try:
        from mypyc.build import mypycify
    except ImportError as error:
        say(f"mypyc is not available ({error}); kvpool will run its python backend")
        return []
    try:
        # (Optional packages the core's imports reach, valkey or msgspec, may be absent from
        # the build's environment: their types do not matter to the compiled code.)
        flags = ["--ignore-missing-imports", "--no-warn-unused-ignores"]
        return list(
            mypycify(
                [*flags, *(f"src/kvpool/{path}" for path in modules)],
                opt_level="3",
                debug_level="0",
                target_dir=str(ROOT / "build" / "mypyc"),
            )
        )
    except BaseException:  # mypyc exits on a type error in the sources
        traceback.print_exc()
        say("mypyc failed; kvpool will run its python backend")
        return []


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildNative})
