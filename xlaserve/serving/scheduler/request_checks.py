"""What the scheduler refuses, by name: a request that could never run (`check_request`, at
`Scheduler.add`) and samples that do not match the plan they answer (`check_samples`, at
`Scheduler.update`).  Host-only."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Sequence as Sequence_

from xlaserve.serving.scheduler.config import SchedulerConfig
from xlaserve.serving.scheduler.step_plan import ScheduledSeq, StepPlan
from xlaserve.serving.types import GenerationRequest


def check_request(request: GenerationRequest, cfg: SchedulerConfig,
                  blocks_needed: Callable[[int], int]) -> None:
    """ValueError when `request` could never run under `cfg`: no prompt, a negative id, no
    room for output, or more KV blocks (`blocks_needed(tokens)`) than the pool has."""
    rid, prompt = request.request_id, request.prompt_token_ids
    if not prompt:
        raise ValueError(f"request {rid!r}: prompt_token_ids is empty")
    if min(prompt) < 0:
        raise ValueError(f"request {rid!r}: negative token id {min(prompt)} in the prompt")
    if len(prompt) >= cfg.max_model_len:
        raise ValueError(f"request {rid!r}: prompt has {len(prompt)} tokens, max_model_len="
                         f"{cfg.max_model_len} leaves no room for output")
    done = len(request.output_token_ids)
    if done >= request.sampling.max_tokens or len(prompt) + done >= cfg.max_model_len:
        raise ValueError(f"request {rid!r}: its {done} output_token_ids leave no room "
                         f"for output (max_tokens={request.sampling.max_tokens})")
    # The last sampled token never needs KV: at most max_len - 1 positions are computed.
    max_len = min(len(prompt) + request.sampling.max_tokens, cfg.max_model_len)
    need = blocks_needed(max_len - 1)
    if need > cfg.num_usable_blocks:
        raise ValueError(f"request {rid!r}: up to {max_len} tokens need {need} KV blocks of "
                         f"{cfg.block_size}, the pool has {cfg.num_usable_blocks}")


def check_samples(plan: StepPlan, sampled: Mapping[str, int | Sequence_[int]],
                  live: Mapping[str, ScheduledSeq]) -> dict[str, tuple[int, ...]]:
    """`sampled` as tuples (an int per sampling row, the 1 + k samples of a verify row), or
    ValueError when it names a row that does not sample, misses a `live` sampling row (the
    requests not ended since), holds a negative id or the wrong count for a row."""
    rows = {r.request_id: r for r in plan.rows if r.sample}
    extra = sorted(set(sampled) - set(rows))
    missing = sorted(set(live) - set(sampled))
    given = {rid: (v,) if isinstance(v, int) else tuple(v) for rid, v in sampled.items()}
    negative = {rid: sampled[rid] for rid, t in given.items() if min(t, default=0) < 0}
    shape = {rid: len(t) for rid, t in given.items()
             if rid in rows and len(t) != rows[rid].num_samples}
    if extra or missing or negative or shape:
        raise ValueError(f"step {plan.step_id}: samples for non-sampling rows {extra}, "
                         f"missing for {missing}, negative {negative}, wrong count {shape} "
                         "(a verify row samples 1 + its drafts)")
    return given
