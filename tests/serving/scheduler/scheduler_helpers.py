"""Helpers for the scheduler tests: tiny requests, a deterministic sampler, step drivers."""

from __future__ import annotations

import zlib

from xlaserve.serving.scheduler import Scheduler, StepPlan
from xlaserve.serving.types import GenerationRequest, SamplingParams, Tier

Row = tuple[str, int, int, bool]  # request id, start position, tokens, sample


def req(rid: str, prompt: list[int] | int, *, max_tokens: int = 16, tier: Tier = Tier.FREE,
        priority: int = 0, tenant: str = "", deadline: float | None = None,
        arrival: float = 0.0) -> GenerationRequest:
    """A request; an int `prompt` is that many tokens of a prompt of this request's own, so
    that requests share a prefix only where a test spells out the same token ids."""
    if isinstance(prompt, int):
        start = 100 + 1000 * (zlib.crc32(rid.encode()) % 1000)
        prompt = list(range(start, start + prompt))
    tokens = prompt
    return GenerationRequest(rid, tokens, SamplingParams(max_tokens=max_tokens), tier, priority,
                             tenant, deadline, arrival)


def token_for(rid: str, position: int) -> int:
    """The fake model: the token a request samples at a position, independent of batching."""
    return 1000 + 10 * position + sum(map(ord, rid)) % 10


def samples(plan: StepPlan) -> dict[str, int]:
    return {r.request_id: token_for(r.request_id, r.sample_position)
            for r in plan.rows if r.sample}


def rows(plan: StepPlan) -> list[Row]:
    return [(r.request_id, r.start_position, r.num_tokens, r.sample) for r in plan.rows]


def step(s: Scheduler, now: float = 0.0) -> StepPlan:
    """schedule + update (alternating mode), then finish requests that reached their length."""
    plan = s.schedule(now)
    s.update(plan, samples(plan))
    for rid in plan.sampling_ids:
        if rid in s and s.length_finish_reason(rid):
            s.finish(rid, "length")
    s.check_integrity()
    return plan
