"""What a prefix-cache replay measures at one cache size (`replay.prefix` through the manager,
`replay.belady` for the offline optimum)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrefixCacheResult:
    capacity_blocks: int
    policy: str
    measured_tokens: int
    hit_tokens: int
    requests: int
    partial: bool = False  # stopped early
    tier_ratios: tuple[int, int] = (0, 0)  # host and disk levels, in GPU capacities
    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)  # served from each level

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.measured_tokens if self.measured_tokens else 0.0


__all__ = ["PrefixCacheResult"]
