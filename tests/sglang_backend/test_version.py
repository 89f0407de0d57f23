"""The backend refuses, at import, SGLang releases it was not built on; and refuses bad
extra-config keys by name before anything is built."""

from __future__ import annotations

import importlib
import sys
from importlib import metadata

import pytest

pytest.importorskip("sglang", reason="needs SGLang (scripts/test.sh runs this in its venv)")


def fresh_import(monkeypatch, version: str):
    real = metadata.version
    monkeypatch.setattr(
        metadata, "version", lambda name: version if name == "sglang" else real(name)
    )
    for name in [n for n in sys.modules if n.startswith("kvpool.integrations.sglang")]:
        monkeypatch.delitem(sys.modules, name)
    return importlib.import_module("kvpool.integrations.sglang")


@pytest.mark.parametrize("version", ["0.5.22", "0.5.24", "0.4.10.post2", "1.0.0", "dev"])
def test_unsupported_sglang_is_refused_by_name(monkeypatch, version):
    with pytest.raises(ImportError, match=rf"supports SGLang 0\.5\.23; this is SGLang {version}"):
        fresh_import(monkeypatch, version)


@pytest.mark.parametrize("version", ["0.5.23", "0.5.23.post1", "0.5.23+cpu"])
def test_supported_sglang_imports(monkeypatch, version):
    module = fresh_import(monkeypatch, version)
    assert module.KVPoolHiCacheStorage.__name__ == "KVPoolHiCacheStorage"


def test_the_dynamic_loader_finds_the_backend():
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    cls = StorageBackendFactory._load_backend_class(
        "kvpool.integrations.sglang", "KVPoolHiCacheStorage", "kvpool"
    )
    assert issubclass(cls, HiCacheStorage)


@pytest.mark.parametrize(
    ("extra", "named", "allowed"),
    [
        ({"staging_bytes": 0}, "staging_bytes", "an integer >= 1"),
        ({"disk_bytes": 1 << 20}, "disk_path", "an existing directory"),
        ({"disk_path": "/tmp"}, "disk_bytes", "> 0 when disk_path"),
        ({"eviction_policy": "fifo"}, "eviction_policy", "one of"),
        ({"remote_url": "http://x"}, "remote_url", "a server URL"),
        ({"model_id": " "}, "model_id", "a non-empty string"),
        ({"timeout_ms": -1}, "timeout_ms", "an integer >= 1"),
        ({"disk_persist": "yes"}, "disk_persist", "true or false"),
        ({"hostbytes": 5}, "hostbytes", "left out"),
    ],
)
def test_bad_extra_config_keys_are_named(extra, named, allowed):
    from kvpool.errors import ConfigError
    from kvpool.integrations.sglang.settings import BackendSettings

    with pytest.raises(ConfigError, match=rf"\['{named}'\]=.*must be {allowed}"):
        BackendSettings.parse(extra)
