"""Workloads for `kvpool replay`: trace loaders and seeded synthetic generators.

Every workload is a list of `Request`s: arrival time, prompt token ids and output length.
Mooncake traces name each 512-token block by a prefix-chained hash id; each id becomes a fixed,
deterministic block of token ids, so the manager's own hashing and radix tree do the matching.
"""

from __future__ import annotations

import csv
import json
import os
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime

from kvpool.errors import ArgumentError

MOONCAKE_BLOCK = 512
_TOKEN_SPACE = 2**31


@dataclass
class Request:
    """One request of a workload. A trace with block hash ids builds its prompt tokens on
    demand (`tokens()`), so a long trace does not hold every prompt in memory."""

    arrival: float  # seconds from the start of the trace
    input_length: int
    output_length: int
    prompt: list[int] | None = None
    block_ids: tuple[int, ...] = ()  # the trace's 512-token block hash ids, when it has them

    def tokens(self) -> list[int]:
        if self.prompt is not None:
            return self.prompt
        prompt: list[int] = []
        for index, hash_id in enumerate(self.block_ids):
            size = min(MOONCAKE_BLOCK, self.input_length - index * MOONCAKE_BLOCK)
            prompt.extend(mooncake_block_tokens(hash_id, size))
        return prompt


class TraceError(ArgumentError):
    """A trace file is missing or malformed (the message names the file and line)."""


def mooncake_block_tokens(hash_id: int, length: int = MOONCAKE_BLOCK) -> list[int]:
    """The token ids standing for one Mooncake block: distinct for distinct ids (below 2**22)."""
    base = (hash_id * MOONCAKE_BLOCK) % _TOKEN_SPACE
    return list(range(base, base + length))


def load_mooncake(path: str | os.PathLike[str], limit: int | None = None) -> list[Request]:
    """Mooncake JSONL: timestamp (ms), input_length, output_length, hash_ids (512-token blocks)."""
    requests: list[Request] = []
    with _open(path) as lines:
        for number, line in _numbered(path, lines):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ids = [int(i) for i in row["hash_ids"]]
                length = int(row["input_length"])
                output = int(row["output_length"])
                arrival = float(row["timestamp"]) / 1000.0
            except (ValueError, KeyError, TypeError) as error:
                raise TraceError(f"{path}:{number}: not a Mooncake trace line ({error})") from None
            if length <= 0 or output < 0 or len(ids) != -(-length // MOONCAKE_BLOCK):
                raise TraceError(
                    f"{path}:{number}: input_length {length} needs {-(-length // MOONCAKE_BLOCK)} "
                    f"hash_ids of {MOONCAKE_BLOCK} tokens, the line has {len(ids)}"
                )
            requests.append(Request(arrival, length, output, block_ids=tuple(ids)))
    return requests


def load_azure(
    path: str | os.PathLike[str], limit: int | None = None, seed: int = 0
) -> list[Request]:
    """Azure LLM inference CSV: TIMESTAMP, ContextTokens, GeneratedTokens (no prefix
    information: every prompt is fresh random tokens)."""
    rng = random.Random(seed)
    requests: list[Request] = []
    start: datetime | None = None
    with _open(path) as lines:
        reader = csv.reader(line for _, line in _numbered(path, lines))
        header = next(reader, None)
        if header is None or [h.strip() for h in header[:3]] != [
            "TIMESTAMP",
            "ContextTokens",
            "GeneratedTokens",
        ]:
            raise TraceError(
                f"{path}:1: expected the header TIMESTAMP,ContextTokens,GeneratedTokens"
            )
        for number, row in enumerate(reader, 2):
            if limit is not None and len(requests) >= limit:
                break
            try:
                when = datetime.fromisoformat(row[0].strip()[:26])
                context, generated = int(row[1]), int(row[2])
            except (ValueError, IndexError) as error:
                raise TraceError(f"{path}:{number}: not an Azure trace row ({error})") from None
            start = start or when
            prompt = [rng.randrange(_TOKEN_SPACE) for _ in range(max(context, 1))]
            requests.append(Request((when - start).total_seconds(), len(prompt), generated, prompt))
    return requests


def _open(path: str | os.PathLike[str]):  # type: ignore[no-untyped-def]
    if not os.path.isfile(path):
        raise TraceError(f"trace={os.fspath(path)!r} is invalid: no such file")
    return open(path, encoding="utf-8", newline="")


def _numbered(path: str | os.PathLike[str], lines: Iterable[str]) -> Iterator[tuple[int, str]]:
    """(line number, line), with undecodable bytes a `TraceError` naming the line."""
    number = 0
    iterator = iter(lines)
    while True:
        number += 1
        try:
            line = next(iterator)
        except StopIteration:
            return
        except UnicodeDecodeError:
            raise TraceError(
                f"{os.fspath(path)}:{number}: not a text trace (the bytes are not UTF-8)"
            ) from None
        yield number, line


def _zipf(rng: random.Random, n: int, exponent: float) -> int:
    """An index in [0, n) with probability proportional to 1 / (rank + 1) ** exponent."""
    weights = [1.0 / (rank + 1) ** exponent for rank in range(n)]
    return rng.choices(range(n), weights)[0]


def synthetic_conversations(
    num_conversations: int = 60,
    turns: int = 4,
    system_prompts: int = 4,
    system_prompt_length: int = 1024,
    user_length: tuple[int, int] = (64, 512),
    output_length: tuple[int, int] = (32, 256),
    rate: float = 4.0,
    zipf: float = 1.1,
    seed: int = 0,
) -> list[Request]:
    """Multi-turn chats: each conversation starts with one of a few shared system prompts (Zipf
    popularity) and every turn's prompt is the whole conversation so far plus a new user
    message. Conversations start as a Poisson process of `rate` per second; turns follow their
    previous answer after a think time."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(_TOKEN_SPACE) for _ in range(system_prompt_length)]
        for _ in range(system_prompts)
    ]
    requests = []
    start = 0.0
    for _ in range(num_conversations):
        start += rng.expovariate(rate)
        history = list(prompts[_zipf(rng, system_prompts, zipf)])
        when = start
        for _ in range(turns):
            history += [rng.randrange(_TOKEN_SPACE) for _ in range(rng.randint(*user_length))]
            output = rng.randint(*output_length)
            requests.append(Request(when, len(history), output, list(history)))
            history += [rng.randrange(_TOKEN_SPACE) for _ in range(output)]
            when += output * 0.02 + rng.expovariate(0.2)
    requests.sort(key=lambda request: request.arrival)
    return requests


def synthetic_system_prompts(
    num_requests: int = 400,
    system_prompts: int = 8,
    system_prompt_length: tuple[int, int] = (512, 4096),
    user_length: tuple[int, int] = (32, 512),
    output_length: tuple[int, int] = (16, 256),
    rate: float = 20.0,
    zipf: float = 1.1,
    seed: int = 0,
) -> list[Request]:
    """Independent requests sharing a few long system prompts with Zipf popularity."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(_TOKEN_SPACE) for _ in range(rng.randint(*system_prompt_length))]
        for _ in range(system_prompts)
    ]
    requests = []
    when = 0.0
    for _ in range(num_requests):
        when += rng.expovariate(rate)
        prompt = prompts[_zipf(rng, system_prompts, zipf)] + [
            rng.randrange(_TOKEN_SPACE) for _ in range(rng.randint(*user_length))
        ]
        requests.append(Request(when, len(prompt), rng.randint(*output_length), prompt))
    return requests
