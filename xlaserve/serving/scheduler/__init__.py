"""The iteration scheduler: every step, which requests run how many tokens, and where.

    engine --add(GenerationRequest) / abort / finish--> Scheduler
    Scheduler.schedule(now) --StepPlan (rows: tokens, positions, block tables, slots)--> runner
    runner --sampled token ids--> Scheduler.update(plan, sampled) --> engine emits them
    Scheduler --allocate / cache / free--> kv_cache.KVCacheManager (block ids only)

Plain Python, no jax; `scheduler.py` documents the one scheduling rule and the pipelining
protocol (PENDING_TOKEN).
"""

from xlaserve.serving.scheduler.config import SchedulerConfig
from xlaserve.serving.scheduler.priority import effective_tier, priority_key, waiting_key
from xlaserve.serving.scheduler.scheduler import FINISH_REASONS, Scheduler
from xlaserve.serving.scheduler.scheduler_stats import SchedulerStats
from xlaserve.serving.scheduler.sequence import RequestState, Sequence, SequenceStatus
from xlaserve.serving.scheduler.step_plan import PENDING_TOKEN, ScheduledSeq, StepPlan

__all__ = [
    "FINISH_REASONS",
    "PENDING_TOKEN",
    "RequestState",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "Sequence",
    "SequenceStatus",
    "StepPlan",
    "effective_tier",
    "priority_key",
    "waiting_key",
]
