"""One request's scheduling state: its tokens and how many of them have KV in the cache.

    all_token_ids:  [ prompt ........ | generated ..... | PENDING? ]
    positions:       0                                  len - 1
                    |<-- num_computed_tokens -->|<-- scheduled next -->|

The one rule (see scheduler.py) only ever compares `num_computed_tokens` with
`len(all_token_ids)`. PENDING_TOKEN marks a token sampled on device but not yet reported by
`Scheduler.update`; placeholders only ever sit at the tail.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from xlaserve.serving.scheduler.step_plan import PENDING_TOKEN
from xlaserve.serving.types import GenerationRequest


class SequenceStatus(str, Enum):
    WAITING = "waiting"   # not holding blocks: new, or preempted (recompute)
    RUNNING = "running"   # holds blocks, scheduled every step it fits the budget


@dataclass
class Sequence:
    request: GenerationRequest
    seq_no: int                          # order of `add`: the last tie-breaker
    all_token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_cached_tokens: int | None = None  # prefix-hit tokens at first admission
    num_preemptions: int = 0
    requeued: bool = False               # preempted and waiting: goes ahead of equal peers
    num_reserved_drafts: int = 0         # KV slots reserved for draft tokens in flight
    num_draft_tokens: int = 0            # draft tokens verified for it so far
    num_accepted_tokens: int = 0         # of those, accepted

    @classmethod
    def from_request(cls, request: GenerationRequest, seq_no: int) -> Sequence:
        prompt = list(request.prompt_token_ids)
        return cls(request, seq_no, prompt + list(request.output_token_ids), len(prompt))

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def speculates(self) -> bool:
        """May its decodes verify draft tokens?  Not when it opted out, nor with penalties
        (their bias depends on every token before the one sampled), nor under an output
        constraint (a draft position's allowed tokens depend on the drafts before it)."""
        s = self.request.sampling
        return (self.request.speculative and s.presence_penalty == 0
                and s.frequency_penalty == 0 and s.constraint is None)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_remaining(self) -> int:
        """Tokens still to compute: what the one rule schedules from."""
        return len(self.all_token_ids) - self.num_computed_tokens

    @property
    def num_pending(self) -> int:
        n = 0
        while n < len(self.all_token_ids) and self.all_token_ids[-1 - n] == PENDING_TOKEN:
            n += 1
        return n

    @property
    def num_known_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_pending

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, placeholders included."""
        return len(self.all_token_ids) - self.num_prompt_tokens

    def output_limit_reached(self, max_model_len: int, *, known_only: bool) -> bool:
        """max_tokens or max_model_len reached, counting placeholders unless `known_only`."""
        n = self.num_known_tokens if known_only else self.num_tokens
        return (n - self.num_prompt_tokens >= self.request.sampling.max_tokens
                or n >= max_model_len)


@dataclass(frozen=True)
class RequestState:
    """A read-only snapshot of one request, for the engine (usage, metrics)."""

    request_id: str
    status: str                          # waiting | running | finished reason
    num_prompt_tokens: int
    output_token_ids: tuple[int, ...]    # PENDING_TOKEN where not reported yet
    num_computed_tokens: int
    num_cached_tokens: int               # prompt tokens served by the prefix cache
    num_preemptions: int
    num_draft_tokens: int = 0            # speculative draft tokens verified
    num_accepted_tokens: int = 0         # of those, accepted

    @classmethod
    def of(cls, seq: Sequence, status: str | None = None) -> RequestState:
        cached = min(seq.num_cached_tokens or 0, seq.num_prompt_tokens)
        return cls(seq.request_id, status or seq.status.value, seq.num_prompt_tokens,
                   tuple(seq.all_token_ids[seq.num_prompt_tokens:]), seq.num_computed_tokens,
                   cached, seq.num_preemptions, seq.num_draft_tokens,
                   seq.num_accepted_tokens)
