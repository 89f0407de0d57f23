"""Lookups that wait for I/O without holding vLLM's scheduler: a request whose lookup needs the
disk or the remote tier gets "not yet" (`None` from `get_num_new_matched_tokens`) while the
manager's look-ahead threads read (`KVCacheManager.look_ahead`), and its answer on a later
step, once they are done. What needs no I/O is answered at once. At most `limit` lookups wait
at a time; past that a lookup is a miss (the engine computes), never a wait."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import Any

from kvpool.lookahead import Lookahead
from kvpool.tokens import Token


class Answer(enum.Enum):
    READY = "ready"  # the lookahead is done: create the request from it now
    WAITING = "waiting"  # its I/O runs: ask again on a later step
    SKIPPED = "skipped"  # too many wait already: a miss


class AsyncLookups:
    """The look-aheads of the requests vLLM was told "not yet", by request id."""

    def __init__(self, manager: Any, limit: int = 256) -> None:
        self.manager = manager
        self.limit = limit
        self._waiting: dict[str, Lookahead] = {}
        self.started = 0  # look-aheads that had I/O to do
        self.skipped = 0  # lookups made misses: `limit` were waiting

    def ask(
        self, request_id: str, scope: object, tokens: list[Token]
    ) -> tuple[Answer, Lookahead | None]:
        """The request's lookahead when ready (started now or on an earlier step)."""
        lookahead = self._waiting.get(request_id)
        if lookahead is None:
            lookahead = self.manager.look_ahead(scope, tokens)
            if lookahead.ready:
                return Answer.READY, lookahead
            if len(self._waiting) >= self.limit:
                lookahead.cancel()
                self.skipped += 1
                return Answer.SKIPPED, None
            self.started += 1
            self._waiting[request_id] = lookahead
            return Answer.WAITING, None
        if not lookahead.ready:
            return Answer.WAITING, None
        del self._waiting[request_id]
        return Answer.READY, lookahead

    def wait_any(
        self,
        timeout_s: float,
        every_s: float = 0.0002,
        wake: Callable[[], bool] | None = None,
    ) -> bool:
        """Sleep until a waiting lookup is ready (True), `wake()` is true or `timeout_s`
        passed (False)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if any(lookahead.ready for lookahead in self._waiting.values()):
                return True
            if wake is not None and wake():
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(every_s, left))

    def cancel(self, request_id: str) -> bool:
        """The request went away (finished, aborted): drop its look-ahead."""
        lookahead = self._waiting.pop(request_id, None)
        if lookahead is None:
            return False
        lookahead.cancel()
        return True

    def cancel_all(self) -> None:
        for request_id in list(self._waiting):
            self.cancel(request_id)

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._waiting


__all__ = ["Answer", "AsyncLookups"]
