"""Builds the native backend: the core's modules (src/kvpool/_native_modules.py) compiled by
mypyc, and its hand-written C modules (linked to OpenSSL's libcrypto for SHA-256). Best effort: if mypyc or the C compiler fails, kvpool installs without it and runs its
python backend (`kvpool info` says which backend runs, and why). KVPOOL_BUILD_NATIVE=0 skips it.
"""

from __future__ import annotations

import hashlib
import os
import sys
import traceback
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
PACKAGE = ROOT / "src" / "kvpool"


def native_modules() -> tuple[list[str], list[str], str, list[str]]:
    """The mypyc modules, the C modules, the stamp's name and the files it digests."""
    namespace: dict[str, object] = {}
    exec((PACKAGE / "_native_modules.py").read_text(), namespace)
    stamped = namespace["stamped_sources"]()  # type: ignore[operator]
    return (
        list(namespace["NATIVE_MODULES"]),  # type: ignore[call-overload]
        list(namespace["C_MODULES"]),  # type: ignore[call-overload]
        str(namespace["STAMP"]),
        list(stamped),
    )


def sources_digest(paths: list[str]) -> str:
    # (the same digest as kvpool._backends.sources_digest, which checks it at import)
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.encode() + b"\0" + (PACKAGE / path).read_bytes() + b"\0")
    return digest.hexdigest()


def c_extension(path: str) -> Extension:
    """`chain.py` -> the extension `kvpool.chain` built from `chain.c`."""
    stem = path.removesuffix(".py")
    return Extension(
        "kvpool." + stem.replace("/", "."),
        [f"src/kvpool/{stem}.c"],
        libraries=["crypto"],
        extra_compile_args=["-O2", "-Wno-deprecated-declarations"],
    )


def say(message: str) -> None:
    print(f"kvpool setup: {message}", file=sys.stderr, flush=True)


class BuildNative(build_ext):
    """build_ext that never fails the install: a module that does not build leaves the native
    backend unbuilt, and the stamp (written only after every module built) is then absent."""

    def run(self) -> None:
        if not self.extensions:
            return
        modules, c_modules, stamp, stamped = native_modules()
        package_dir = Path(self.get_ext_fullpath("kvpool.records")).parent
        (package_dir / stamp).unlink(missing_ok=True)
        try:
            super().run()
        except Exception:  # a missing compiler, a compile error: install the python backend
            traceback.print_exc()
            say("the native backend did not build; kvpool will run its python backend")
            return
        package_dir.mkdir(parents=True, exist_ok=True)
        (package_dir / stamp).write_text(sources_digest(stamped) + "\n")
        say(f"native backend built ({len(modules)} compiled modules, {len(c_modules)} in C)")


# The commands that build extensions (pip calls setup.py for metadata first: no mypyc there).
BUILDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install"}


def up_to_date(modules: list[str], stamp: str, stamped: list[str]) -> bool:
    """Whether the checkout's compiled modules match its sources (an editable reinstall)."""
    stamp_file = PACKAGE / stamp
    return (
        stamp_file.is_file()
        and stamp_file.read_text().strip() == sources_digest(stamped)
        and all(list(PACKAGE.glob(path.removesuffix(".py") + ".*.so")) for path in modules)
    )


def extensions() -> list[object]:
    if not BUILDS & set(sys.argv[1:]):
        return []
    if os.environ.get("KVPOOL_BUILD_NATIVE", "1") == "0":
        say("KVPOOL_BUILD_NATIVE=0: not building the native backend")
        return []
    modules, c_modules, stamp, stamped = native_modules()
    if "editable_wheel" in sys.argv and up_to_date([*modules, *c_modules], stamp, stamped):
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
        compiled = mypycify(
            [*flags, *(f"src/kvpool/{path}" for path in modules)],
            opt_level="3",
            debug_level="0",
            target_dir=str(ROOT / "build" / "mypyc"),
        )
        return [*compiled, *(c_extension(path) for path in c_modules)]
    except BaseException:  # mypyc exits on a type error in the sources
        traceback.print_exc()
        say("mypyc failed; kvpool will run its python backend")
        return []


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildNative})
