"""What the scheduler reports to /metrics: queue sizes, preemptions, KV usage, prefix hits,
speculative drafts."""

from __future__ import annotations

from dataclasses import dataclass, field

from xlaserve.serving.kv_cache import KVCacheUsage, PrefixCacheStats
from xlaserve.serving.speculative import SpecStats


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions: int      # total since start
    num_finished: int         # total since start, every reason
    num_steps: int            # plans emitted, empty ones included
    kv_cache: KVCacheUsage
    prefix_cache: PrefixCacheStats
    spec: SpecStats = field(default_factory=SpecStats)   # speculative decoding, cumulative

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_cache.hit_rate
