"""The two backends: selection by `KVPOOL_BACKEND`, the fall-back to python (with one line
saying why) when the native one is not built, stale or broken, and the differential fuzzer that
drives both with the same operations and compares every decision."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvpool
from kvpool import _backends
from tests.fuzz.fuzzer import (
    LAYOUTS,
    REMOTE_LAYOUTS,
    FuzzFailure,
    backends,
    replay_backends,
    shrink,
)

SRC = Path(kvpool.__file__).resolve().parents[1]
NATIVE_BUILT = _backends._why_not_native() == "" or kvpool.backend() == "native"
needs_native = pytest.mark.skipif(not NATIVE_BUILT, reason="the native backend is not built here")

PROBE = (
    "import kvpool, kvpool.radix as r, kvpool.cache.kvcache as k;"
    "i = kvpool.backend_info(); print(i.name, r.__file__.endswith('.py'),"
    " k.__file__.endswith('.py'), i.reason, sep='|')"
)


def probe(backend: str | None, src: Path = SRC) -> tuple[str, bool, str, str]:
    """(backend, core modules loaded from source, reason, stderr) of a fresh interpreter."""
    env = {key: value for key, value in os.environ.items() if key != "KVPOOL_BACKEND"}
    if backend is not None:
        env["KVPOOL_BACKEND"] = backend
    env["PYTHONPATH"] = str(src)
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    name, radix_source, kvcache_source, reason = done.stdout.strip().split("|")
    assert radix_source == kvcache_source
    return name, radix_source == "True", reason, done.stderr


def test_the_python_backend_loads_the_core_from_source_even_beside_compiled_modules():
    name, from_source, reason, err = probe("python")
    assert (name, from_source, reason, err) == ("python", True, "", "")


@needs_native
def test_the_native_backend_is_the_default_and_loads_compiled_modules():
    for asked in (None, "native", " Native "):
        name, from_source, reason, err = probe(asked)
        assert (name, from_source, reason, err) == ("native", False, "", "")


def test_an_unknown_backend_is_refused_by_name():
    env = dict(os.environ, KVPOOL_BACKEND="cpp")
    done = subprocess.run(
        [sys.executable, "-c", "import kvpool"], env=env, capture_output=True, text=True
    )
    assert done.returncode != 0
    assert "KVPOOL_BACKEND='cpp': not a backend (choose one of native, python)" in done.stderr


def _copy_of_src(tmp_path: Path, compiled: bool = True) -> Path:
    copy = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", *([] if compiled else ["*.so"]))
    shutil.copytree(SRC, copy, ignore=ignore)
    return copy


def test_without_compiled_modules_it_falls_back_to_python_and_says_why(tmp_path):
    name, from_source, reason, err = probe("native", _copy_of_src(tmp_path, compiled=False))
    assert (name, from_source) == ("python", True)
    assert reason.startswith("not built")
    assert err.count("\n") == 1 and "running the python backend" in err


@needs_native
def test_an_edited_source_makes_the_native_backend_stale(tmp_path):
    copy = _copy_of_src(tmp_path)
    radix = copy / "kvpool" / "radix.py"
    radix.write_text(radix.read_text() + "\n# edited after the build\n")
    name, from_source, reason, err = probe(None, copy)
    assert (name, from_source) == ("python", True)
    assert reason.startswith("stale") and "pip install -e ." in err


@needs_native
def test_a_broken_compiled_module_falls_back_to_python(tmp_path):
    copy = _copy_of_src(tmp_path)
    shared = list(copy.glob("*__mypyc*.so"))  # the compiled core: its modules' one library
    assert shared
    for library in shared:
        library.write_bytes(b"not a shared library")
    name, from_source, reason, err = probe(None, copy)
    assert (name, from_source) == ("python", True)
    assert reason.startswith("its modules fail to import") and err.count("\n") == 1


@needs_native
@pytest.mark.parametrize("layout", sorted(set(LAYOUTS) - REMOTE_LAYOUTS))
def test_both_backends_take_the_same_decisions(layout, request):
    """The differential fuzzer: every decision of every operation, on both backends."""
    ops, seed = request.config.getoption("--fuzz-ops"), request.config.getoption("--fuzz-seed")
    try:
        stats = backends(layout, seed, ops // 2)
    except FuzzFailure as failure:
        small = shrink(layout, seed, failure.ops, failure.error, 60, replay_backends)
        pytest.fail(f"{layout}: {failure}; shrunk to {len(small)}: {small}")
    # The runs reached what decisions depend on: a learned policy, drops, reuse.
    assert stats["decisions compared"] > ops // 20 and stats["pages dropped"] > 0
    assert stats["reused tokens"] > 0
