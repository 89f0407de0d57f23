"""An engine's extra-config dict (vLLM's `kv_connector_extra_config`, SGLang's
`hicache_storage_backend_extra_config`), read key by key: a bad value is a `ConfigError`
naming the dict, the key and what it may be, before anything is built."""

from __future__ import annotations

from typing import Any, NoReturn

from kvpool.errors import ConfigError


class ExtraConfig:
    def __init__(self, name: str) -> None:
        self.name = name

    def fail(self, key: str, value: object, allowed: str) -> NoReturn:
        raise ConfigError(f"{self.name}[{key!r}]={value!r} is invalid: must be {allowed}")

    def integer(self, extra: dict[str, Any], key: str, default: int, minimum: int) -> int:
        value = extra.get(key, default)
        if type(value) is not int or value < minimum:
            self.fail(key, value, f"an integer >= {minimum}")
        return int(value)

    def flag(self, extra: dict[str, Any], key: str, default: bool) -> bool:
        value = extra.get(key, default)
        if type(value) is not bool:
            self.fail(key, value, "true or false")
        return bool(value)

    def string(self, extra: dict[str, Any], key: str, default: str | None) -> str | None:
        value = extra.get(key, default)
        if value is not None and not isinstance(value, str):
            self.fail(key, value, "a string")
        return value


__all__ = ["ExtraConfig"]
