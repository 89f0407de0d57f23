"""A KV-aware router's view of a KV event stream, run as its own process.

    python tests/kv_event_subscriber.py PUB_ENDPOINT REPLAY_ENDPOINT vllm|independent

Decodes with vLLM's own event classes (`vllm`: in an environment that has vLLM) or with
msgspec structs declared here from the wire format alone (`independent`: imports nothing from
kvpool). It subscribes, asks for a replay from sequence 0 (so it may join late), then applies
live batches in order, asking for a replay again if it sees a gap. Its view: per medium, the set
of (block hash, group) pairs stored and not removed since the last AllBlocksCleared.

Commands on stdin, one per line: `view N` waits until batch N was applied and prints the view
as one JSON line; `quit` stops.
"""

from __future__ import annotations

import json
import select
import sys
from typing import Any

import msgspec
import zmq


class Event(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class BlockStored(Event):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(Event):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(Event):
    pass


class Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def independent_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Batch)


def vllm_decoder() -> msgspec.msgpack.Decoder:
    from vllm.distributed.kv_events import KVEventBatch

    return msgspec.msgpack.Decoder(KVEventBatch)


class View:
    def __init__(self) -> None:
        self.media: dict[str, set[tuple[int, int]]] = {}
        self.errors: list[str] = []
        self.next_sequence = 0
        self.events = 0

    def apply(self, sequence: int, batch: Any) -> None:
        assert sequence == self.next_sequence, (sequence, self.next_sequence)
        self.next_sequence += 1
        for event in batch.events:
            self.events += 1
            kind = type(event).__name__
            if kind == "AllBlocksCleared":
                self.media.clear()
                continue
            blocks = self.media.setdefault(event.medium, set())
            pairs = [(h, event.group_idx) for h in event.block_hashes]
            if kind == "BlockStored":
                if len(event.token_ids) != event.block_size * len(event.block_hashes):
                    self.errors.append(f"batch {sequence}: {len(event.token_ids)} token ids")
                for pair in pairs:
                    if pair in blocks and event.medium != "EXTERNAL":
                        self.errors.append(f"batch {sequence}: stored twice {pair}")
                    blocks.add(pair)
            else:
                for pair in pairs:
                    if pair not in blocks:
                        self.errors.append(f"batch {sequence}: removed unknown {pair}")
                    blocks.discard(pair)

    def as_json(self) -> str:
        media = {m: sorted([h, g] for h, g in blocks) for m, blocks in self.media.items() if blocks}
        return json.dumps(
            {
                "media": media,
                "errors": self.errors,
                "applied": self.next_sequence - 1,
                "events": self.events,
            }
        )


def main() -> None:
    pub_endpoint, replay_endpoint, kind = sys.argv[1:4]
    decoder = vllm_decoder() if kind == "vllm" else independent_decoder()
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub_endpoint)
    replay = context.socket(zmq.DEALER)
    replay.connect(replay_endpoint)
    view = View()

    def catch_up() -> None:
        """Replay everything from the next sequence number the view needs."""
        replay.send_multipart((b"", view.next_sequence.to_bytes(8, "big")))
        while True:
            _, _, sequence_bytes, payload = replay.recv_multipart()
            sequence = int.from_bytes(sequence_bytes, "big", signed=True)
            if sequence < 0:
                return
            if sequence >= view.next_sequence:
                view.apply(sequence, decoder.decode(payload))

    def receive(timeout_ms: int) -> None:
        if not sub.poll(timeout_ms):
            return
        while sub.poll(0):
            _, sequence_bytes, payload = sub.recv_multipart()
            sequence = int.from_bytes(sequence_bytes, "big")
            if sequence > view.next_sequence:
                catch_up()  # a gap (or a late join): the replay fills it
            if sequence == view.next_sequence:
                view.apply(sequence, decoder.decode(payload))

    catch_up()
    print(json.dumps({"ready": True}), flush=True)
    while True:
        readable, _, _ = select.select([sys.stdin], [], [], 0.01)
        receive(0)
        if not readable:
            continue
        command = sys.stdin.readline().split()
        if not command or command[0] == "quit":
            return
        wanted = int(command[1])
        for attempt in range(3000):
            if view.next_sequence > wanted:
                break
            receive(10)
            if attempt % 20 == 19 and view.next_sequence <= wanted:
                catch_up()  # (a slow-joining SUB may have missed the first live batches)
        print(view.as_json(), flush=True)


if __name__ == "__main__":
    main()
