"""The connector as a client of a `kvpool serve` node daemon (`node_cache`): the daemon's
manager takes the decisions; this engine says hello with its model's slot layout."""

from __future__ import annotations

import os
from typing import Any

from kvpool.integrations.vllm.settings import ConnectorSettings
from kvpool.node.client import NodeClient
from kvpool.node.protocol import VERSION, Hello, Layer


def node_client(
    settings: ConnectorSettings, config: Any, model_id: str, tier_group: int
) -> NodeClient:
    """A client of the node daemon at `settings.node_cache`, said hello to now: a daemon of
    another layout is a `ConfigError` at the engine's start; an absent one is not (the engine
    computes until it is there)."""
    layers = [
        Layer(
            layer.layer_id,
            [(buffer.role, buffer.size) for buffer in layer.buffers],
            layer.sliding_window_size,
        )
        for layer in config.layers
    ]
    hello = Hello(
        VERSION, model_id, config.tokens_per_block, layers, tier_group, f"vllm-{os.getpid()}"
    )
    assert settings.node_cache is not None
    client = NodeClient(
        settings.node_cache,
        hello,
        timeout_s=settings.node_timeout_ms / 1000,
        poll_s=settings.node_poll_us / 1e6,
    )
    client.connect(required=True)
    return client
