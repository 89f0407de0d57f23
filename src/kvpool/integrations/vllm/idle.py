"""The pause of an empty engine step while lookups wait.

While a request waits for its lookup's I/O, vLLM's engine loop has work and steps again at
once: a core spun, the interpreter held against the look-ahead threads and the servers'
processes, and each step a call to every worker. Such a step pauses instead, until a lookup is
ready or `IDLE_WAIT_S` (the most a request arriving meanwhile waits for its first step); or,
where the engine core's input queue is seen (`engine_input_check`), until a lookup is ready,
the engine has input (a request, an abort, a wake-up) or `IDLE_WAIT_WATCHED_S`: fewer empty
steps, and a request arriving meanwhile ends the pause.
"""

from __future__ import annotations

import queue
import sys
from collections.abc import Callable
from types import FrameType

from kvpool.node.store import Store

IDLE_WAIT_S = 0.002
IDLE_WAIT_WATCHED_S = 0.02
_NOT_LOOKED = object()


def engine_input_check(depth: int = 16) -> Callable[[], bool] | None:
    """A check that vLLM's engine core has input waiting, made from the `input_queue` of the
    engine core (`EngineCoreProc`) whose step runs on this thread (found on the caller's stack:
    vLLM hands the connector no handle to it); None where there is none (a test, another
    engine loop)."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            break
        found = getattr(frame.f_locals.get("self"), "input_queue", None)
        if isinstance(found, queue.Queue):
            waiting = found
            return lambda: not waiting.empty()
        frame = frame.f_back
    return None


class IdlePause:
    """One scheduler's pauses (the engine's input check is looked for once, on the first)."""

    def __init__(self) -> None:
        self._engine_input: object = _NOT_LOOKED

    def pause(self, store: Store) -> None:
        """An empty step while lookups wait: pause as the module docstring says."""
        if self._engine_input is _NOT_LOOKED:
            self._engine_input = engine_input_check()
        check = self._engine_input
        if check is None:
            store.idle(IDLE_WAIT_S)
        else:
            assert callable(check)
            store.idle(IDLE_WAIT_WATCHED_S, check)
