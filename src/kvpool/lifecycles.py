"""Life cycles: when a layer's blocks stop being needed, as the history grows.

Full attention keeps every block; a sliding window keeps its sink blocks and the blocks the
window still covers; an SSM layer keeps one state slot per request instead of pages per block.
Layers with equal life cycles form one layer group.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionLifeCycle:
    """Attention blocks: kept forever (`window` None) or while inside the window or a sink block."""

    window: int | None
    num_sink_blocks: int

    def stale_range(self, history_length: int, tokens_per_block: int) -> tuple[int, int]:
        """Block range [beg, end) no longer needed once `history_length` tokens are computed.

        The next step attends from position `history_length`, so the live window is
        [h + 1 - w, h]; sink blocks stay.
        """
        beg = min(-(-history_length // tokens_per_block), self.num_sink_blocks)
        if self.window is None:
            return beg, beg
        return beg, max(beg, (history_length + 1 - self.window) // tokens_per_block)

    def window_floor(self, tokens_per_block: int) -> int:
        """Slots one request needs to make progress: sinks, the window, and one for the slide."""
        if self.window is None:
            return 1
        return self.num_sink_blocks + -(-(self.window - 1) // tokens_per_block) + 1

    def __str__(self) -> str:
        if self.window is None:
            return "full attention"
        sinks = f" + {self.num_sink_blocks} sink blocks" if self.num_sink_blocks else ""
        return f"sliding window {self.window}{sinks}"


@dataclass(frozen=True)
class SsmLifeCycle:
    """Recurrent state: one slot per request, no per-block pages."""

    def stale_range(self, history_length: int, tokens_per_block: int) -> tuple[int, int]:
        return 0, history_length // tokens_per_block

    def window_floor(self, tokens_per_block: int) -> int:
        return 1

    def __str__(self) -> str:
        return "ssm state"


LifeCycle = AttentionLifeCycle | SsmLifeCycle
