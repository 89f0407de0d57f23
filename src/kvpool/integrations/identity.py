"""A model's identity for keys that outlive the process: what the model computes, not its name.

KV written by one process is read by others (the shared tier, a persistent disk level). A
checkpoint replaced under the same path, a new revision of a hub name, another dtype or a
changed config all change the KV bytes while the name stays; keyed by the name, every prefix
hit would then serve the old weights' KV. The identity is a digest of:

- the model's architecture config (as the engine uses it, its path left out);
- a fingerprint of the weights: every weight file's name and size, the safetensors headers
  (tensor names, dtypes, shapes, offsets, metadata) and a few small samples of every tensor's
  bytes (its first, middle and last 4 KiB, for at most `MAX_SAMPLED_TENSORS` tensors spread
  over the checkpoint; 64 evenly spaced samples of other weight files). A fine-tune changes
  the sampled bytes; a copy of the same checkpoint elsewhere does not. It reads a few MiB of
  a 100+ GiB checkpoint;
- whatever else the caller names: dtypes, the page format, the parallel layout.

Nothing in it depends on a file's path, time stamp or the machine, so every server of a fleet
loading the same checkpoint computes the same identity.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SAMPLE_BYTES = 4096
MAX_SAMPLED_TENSORS = 4096  # (a mixture of experts may have 100,000 tensors: sample a spread)
FILE_SAMPLES = 64  # for weight files without a header to read (.bin, .pt, .gguf)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".msgpack", ".h5")
WEIGHT_INDEXES = (".safetensors.index.json", ".bin.index.json")
IGNORED_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_commit_hash")
MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class ModelIdentity:
    """`digest` (hex) goes into keys; `description` says, for a log line, what went into it."""

    digest: str
    description: str

    def __str__(self) -> str:
        return f"{self.digest[:16]} ({self.description})"


@dataclass(frozen=True)
class WeightsFingerprint:
    digest: str
    files: int
    total_bytes: int
    tensors_sampled: int
    bytes_read: int


def _weight_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    found = []
    for entry in sorted(path.iterdir()):
        name = entry.name
        if not entry.is_file() or name.startswith("."):
            continue
        if name.endswith(WEIGHT_SUFFIXES) or name.endswith(WEIGHT_INDEXES):
            found.append(entry)
    return found


def _read_at(file: Any, offset: int, nbytes: int) -> bytes:
    file.seek(offset)
    return bytes(file.read(nbytes))


def _windows(begin: int, end: int) -> list[tuple[int, int]]:
    """Start, middle and end windows of [begin, end), or the whole range when small."""
    size = end - begin
    if size <= 3 * SAMPLE_BYTES:
        return [(begin, size)]
    middle = begin + (size - SAMPLE_BYTES) // 2
    return [(begin, SAMPLE_BYTES), (middle, SAMPLE_BYTES), (end - SAMPLE_BYTES, SAMPLE_BYTES)]


def _safetensors_header(file: Any, size: int) -> tuple[bytes, dict[str, Any]] | None:
    if size < 8:
        return None
    (length,) = struct.unpack("<Q", _read_at(file, 0, 8))
    if length > min(MAX_HEADER_BYTES, size - 8):
        return None
    raw = _read_at(file, 8, length)
    try:
        header = json.loads(raw)
    except ValueError:
        return None
    return (raw, header) if isinstance(header, dict) else None


def fingerprint_weights(path: str | os.PathLike[str]) -> WeightsFingerprint:
    """The weights' fingerprint (see the module docstring). `path`: a checkpoint directory or
    one weight file. `ValueError` when it holds no weight file."""
    root = Path(path)
    files = _weight_files(root)
    if not any(f.name.endswith(WEIGHT_SUFFIXES) for f in files):
        raise ValueError(f"no weight file ({', '.join(WEIGHT_SUFFIXES)}) in {root}")
    digest = hashlib.sha256(b"kvpool-weights-1")
    total = read = 0
    tensors: list[tuple[str, Path, int, int]] = []  # (name, file, begin, end): safetensors
    plain: list[tuple[Path, int]] = []
    for file in files:
        size = file.stat().st_size
        total += size
        digest.update(f"{file.name}\0{size}\0".encode())
        if file.name.endswith(WEIGHT_INDEXES):
            digest.update(file.read_bytes())
            read += size
            continue
        with open(file, "rb") as handle:
            parsed = _safetensors_header(handle, size) if file.suffix == ".safetensors" else None
        if parsed is None:
            plain.append((file, size))
            continue
        raw, header = parsed
        digest.update(raw)
        read += 8 + len(raw)
        base = 8 + len(raw)
        for name in sorted(k for k in header if k != "__metadata__"):
            begin, end = header[name]["data_offsets"]
            tensors.append((name, file, base + int(begin), base + int(end)))
    step = max(1, -(-len(tensors) // MAX_SAMPLED_TENSORS))
    sampled = tensors[::step]
    handles: dict[Path, Any] = {}
    try:
        for name, file, begin, end in sampled:
            handle = handles.get(file) or handles.setdefault(file, open(file, "rb"))  # noqa: SIM115
            digest.update(name.encode() + b"\0")
            for offset, nbytes in _windows(begin, end):
                digest.update(_read_at(handle, offset, nbytes))
                read += nbytes
        for file, size in plain:
            handle = handles.get(file) or handles.setdefault(file, open(file, "rb"))  # noqa: SIM115
            for i in range(FILE_SAMPLES):
                offset = (
                    (size - SAMPLE_BYTES) * i // (FILE_SAMPLES - 1) if size > SAMPLE_BYTES else 0
                )
                chunk = _read_at(handle, offset, SAMPLE_BYTES)
                digest.update(chunk)
                read += len(chunk)
    finally:
        for handle in handles.values():
            handle.close()
    return WeightsFingerprint(digest.hexdigest(), len(files), total, len(sampled), read)


def canonical_config(config: dict[str, Any]) -> str:
    """The config as canonical JSON, its path and version stamps left out."""
    kept = {k: v for k, v in config.items() if k not in IGNORED_CONFIG_KEYS}
    return json.dumps(kept, sort_keys=True, default=str, separators=(",", ":"))


def model_identity(
    config: dict[str, Any], weights: WeightsFingerprint | None, **parts: object
) -> ModelIdentity:
    """The identity of a model computing with `config` and `weights` (None: not found, the
    caller names what stands in for them in `parts`) and every other setting in `parts`."""
    digest = hashlib.sha256(b"kvpool-model-identity-1\0")
    digest.update(canonical_config(config).encode() + b"\0")
    digest.update(b"-" if weights is None else weights.digest.encode())
    for key in sorted(parts):
        digest.update(f"\0{key}={parts[key]!r}".encode())
    said = [f"{k}={parts[k]}" for k in sorted(parts)]
    if weights is None:
        said.append("weights: not found on this machine (not fingerprinted)")
    else:
        said.append(
            f"weights: {weights.files} files, {weights.total_bytes} bytes, "
            f"{weights.tensors_sampled} tensors sampled, {weights.bytes_read} bytes read"
        )
    return ModelIdentity(digest.hexdigest(), ", ".join(said))


def explicit_identity(model_id: str, **parts: object) -> ModelIdentity:
    """A user's own model id in place of the config and weights (the other parts kept)."""
    digest = hashlib.sha256(b"kvpool-model-identity-explicit-1\0" + model_id.encode())
    for key in sorted(parts):
        digest.update(f"\0{key}={parts[key]!r}".encode())
    said = [f"model_id={model_id!r} (given)"] + [f"{k}={parts[k]}" for k in sorted(parts)]
    return ModelIdentity(digest.hexdigest(), ", ".join(said))


__all__ = [
    "ModelIdentity",
    "WeightsFingerprint",
    "canonical_config",
    "explicit_identity",
    "fingerprint_weights",
    "model_identity",
]
