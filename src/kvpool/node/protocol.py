"""The node daemon's messages: msgpack (msgspec) frames on a Unix stream socket, framed by
`multiprocessing.connection` (a length prefix). Every request gets exactly one reply, in order;
an engine has at most one request outstanding. The daemon's reply to `Hello` is followed by
its shared-memory file descriptors (SCM_RIGHTS), one per pool named in `Welcome.pools`."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

import msgspec

from kvpool.errors import ConfigError

VERSION = 1
MAX_MESSAGE = 64 << 20  # bytes; a longer frame is a protocol error (the connection is dropped)


class Layer(msgspec.Struct, array_like=True):
    """One attention layer of the engine's model: its buffers (name, bytes per block) and its
    sliding window (None: full attention)."""

    layer_id: int
    buffers: list[tuple[str, int]]
    window: int | None = None


class Hello(msgspec.Struct, tag="hello"):
    """An engine's first message: who it is (`model`: its identity, which scopes every key),
    the slot layout of its model, the layer group saying where a block is (`tier_group`)."""

    version: int
    model: str
    tokens_per_block: int
    layers: list[Layer]
    tier_group: int = 0
    name: str = ""  # for the daemon's logs


class Lookup(msgspec.Struct, tag="lookup"):
    key: str  # the engine's request id (an asynchronous lookup is asked again by it)
    lora_id: int | None
    salt: str | None
    tokens: list[int]
    async_io: bool = True


class Cancel(msgspec.Struct, tag="cancel"):
    key: str


class PlanSave(msgspec.Struct, tag="plan_save"):
    lora_id: int | None
    salt: str | None
    tokens: list[int]


class CommitSave(msgspec.Struct, tag="commit_save"):
    handle: int
    tokens: list[int]
    first_block: int


class Release(msgspec.Struct, tag="release"):
    handle: int


class Stats(msgspec.Struct, tag="stats"):
    pass


Request = Hello | Lookup | Cancel | PlanSave | CommitSave | Release | Stats


class Welcome(msgspec.Struct, tag="welcome"):
    """The hello was accepted: the pools' file names, whose descriptors follow in this order."""

    pools: list[str]
    daemon: str  # the daemon's instance (pid and start time): a restart changes it


class Refused(msgspec.Struct, tag="refused"):
    reason: str


class LookupReply(msgspec.Struct, tag="lookup_reply"):
    outcome: str  # "hit" or a `store.Outcome` value
    handle: int = 0
    tokens: int = 0
    slots: list[list[int]] = []
    tiers: list[str] = []


class SaveReply(msgspec.Struct, tag="save_reply"):
    outcome: str  # "plan" or a `store.Outcome` value
    handle: int = 0
    first_block: int = 0
    slots: list[list[int]] = []


class Done(msgspec.Struct, tag="done"):
    pass


class StatsReply(msgspec.Struct, tag="stats_reply"):
    stats: dict[str, Any]


Reply = Welcome | Refused | LookupReply | SaveReply | Done | StatsReply

encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)


def socket_path(url: object, name: str = "node_cache") -> str:
    """The path of a `unix:///path/to.sock` URL, or a `ConfigError` naming `name`."""
    if not isinstance(url, str):
        raise ConfigError(f"{name}={url!r} is invalid: must be a string unix:///path/to.sock")
    parsed = urlparse(url)
    if parsed.scheme != "unix" or parsed.netloc or not parsed.path.startswith("/"):
        raise ConfigError(
            f"{name}={url!r} is invalid: must be unix:///absolute/path/to.sock (a Unix socket "
            "of a `kvpool serve` daemon on this node)"
        )
    if len(parsed.path.encode()) > 107:
        raise ConfigError(f"{name}={url!r} is invalid: must be a socket path of at most 107 bytes")
    return parsed.path


__all__ = [
    "MAX_MESSAGE",
    "VERSION",
    "Cancel",
    "CommitSave",
    "Done",
    "Hello",
    "Layer",
    "Lookup",
    "LookupReply",
    "PlanSave",
    "Refused",
    "Release",
    "Reply",
    "Request",
    "SaveReply",
    "Stats",
    "StatsReply",
    "Welcome",
    "socket_path",
]
