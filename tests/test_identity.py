"""A model's identity (kvpool.integrations.identity): what keys that outlive the process carry.
It must change with anything that changes a KV byte (weights, config, dtypes) and with nothing
else (the checkpoint's path, its files' times), and read little of a large checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest

from kvpool.integrations.identity import (
    MAX_SAMPLED_TENSORS,
    SAMPLE_BYTES,
    explicit_identity,
    fingerprint_weights,
    model_identity,
)

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "_name_or_path": "/a/b"}


def write_safetensors(path, tensors: dict[str, np.ndarray], metadata=None) -> None:
    """A real safetensors file (the format is a JSON header and the raw bytes)."""
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        data = np.ascontiguousarray(array).tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
        blobs.append(data)
    if metadata is not None:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def checkpoint(directory, seed: int = 0, big: int = 64 * 1024) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tensors = {
        "embed.weight": rng.standard_normal(big).astype(np.float32),
        "layers.0.q.weight": rng.standard_normal(300).astype(np.float32),
        "norm.weight": rng.standard_normal(7).astype(np.float32),
    }
    directory.mkdir(parents=True, exist_ok=True)
    write_safetensors(directory / "model.safetensors", tensors)
    (directory / "config.json").write_text(json.dumps(CONFIG))
    return tensors


def test_a_copy_elsewhere_has_the_same_identity_and_new_weights_another(tmp_path):
    checkpoint(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    os.utime(tmp_path / "copy" / "model.safetensors", (1, 1))  # (times never count)
    first = fingerprint_weights(tmp_path / "a")
    assert fingerprint_weights(tmp_path / "copy").digest == first.digest
    checkpoint(tmp_path / "a", seed=1)  # a fine-tune replaced under the same path
    assert fingerprint_weights(tmp_path / "a").digest != first.digest


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_a_change_to_one_tensor_changes_the_fingerprint(tmp_path, where):
    """Every sampled tensor is read at its start, middle and end: a fine-tune touching one
    tensor (same shapes, same header, same sizes) is seen."""
    tensors = checkpoint(tmp_path / "m")
    before = fingerprint_weights(tmp_path / "m").digest
    embed = tensors["embed.weight"]
    index = {"start": 0, "middle": len(embed) // 2, "end": len(embed) - 1}[where]
    embed[index] += 1.0
    write_safetensors(tmp_path / "m" / "model.safetensors", tensors)
    assert fingerprint_weights(tmp_path / "m").digest != before


def test_a_large_checkpoint_is_fingerprinted_from_a_few_reads(tmp_path):
    directory = tmp_path / "big"
    tensors = checkpoint(directory, big=8 << 20)  # 32 MiB of one tensor
    write_safetensors(directory / "model-2.safetensors", {"x": tensors["embed.weight"]})
    found = fingerprint_weights(directory)
    assert found.total_bytes > 64 << 20
    assert found.bytes_read < 64 * 1024  # headers and three 4 KiB samples per tensor
    assert found.tensors_sampled == 4


def test_many_tensors_are_sampled_in_a_bounded_spread(tmp_path):
    count = 2 * MAX_SAMPLED_TENSORS + 10
    directory = tmp_path / "moe"
    directory.mkdir()
    write_safetensors(
        directory / "model.safetensors",
        {f"expert.{i}": np.full(4, i, np.float32) for i in range(count)},
    )
    found = fingerprint_weights(directory)
    assert found.tensors_sampled <= MAX_SAMPLED_TENSORS
    assert found.bytes_read < (MAX_SAMPLED_TENSORS + 1) * 3 * SAMPLE_BYTES + (2 << 20)


def test_files_without_a_header_are_sampled_across_their_length(tmp_path):
    weights = tmp_path / "model.gguf"
    data = bytearray(os.urandom(1 << 20))
    weights.write_bytes(data)
    before = fingerprint_weights(weights).digest
    data[len(data) // 2 : len(data) // 2 + SAMPLE_BYTES * 2] = bytes(SAMPLE_BYTES * 2)
    weights.write_bytes(data)
    assert fingerprint_weights(weights).digest != before


def test_no_weights_is_an_error_naming_the_path(tmp_path):
    with pytest.raises(ValueError, match="no weight file"):
        fingerprint_weights(tmp_path)


def test_identity_follows_config_dtypes_and_weights_but_not_the_name(tmp_path):
    checkpoint(tmp_path / "m")
    weights = fingerprint_weights(tmp_path / "m")
    base = model_identity(CONFIG, weights, dtype="bfloat16")
    renamed = dict(CONFIG, _name_or_path="/elsewhere", transformers_version="9")
    assert model_identity(renamed, weights, dtype="bfloat16").digest == base.digest
    changed = dict(CONFIG, rope_theta=1e6)
    assert model_identity(changed, weights, dtype="bfloat16").digest != base.digest
    assert model_identity(CONFIG, weights, dtype="float16").digest != base.digest
    assert model_identity(CONFIG, None, dtype="bfloat16").digest != base.digest
    assert "tensors sampled" in base.description and "dtype=bfloat16" in base.description
    given = explicit_identity("my-model", dtype="bfloat16")
    assert given.digest != base.digest
    assert given.digest == explicit_identity("my-model", dtype="bfloat16").digest
    assert explicit_identity("my-model", dtype="float16").digest != given.digest
