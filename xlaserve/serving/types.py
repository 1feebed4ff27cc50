"""The messages between the front ends (HTTP, gRPC, CLI) and the engine.

    front end --GenerationRequest--> engine.submit() --EngineEvent...--> front end
                                     engine.abort(request_id)

Every accepted request ends with exactly one event whose `finish_reason` is set: "stop",
"length", "abort" or "error" (with `error` saying what went wrong).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum

from xlaserve.serving.structured.constraint import Constraint


class Tier(IntEnum):
    """Service tier; a higher value is served first."""

    FREE = 0
    PAID = 1
    INTERNAL = 2


MAX_INT32 = 2 ** 31 - 1   # integer sampling fields travel to the device as int32


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0      # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                # 0 = off; >= the vocabulary size is off as well
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None       # same seed -> same text, whatever else is in the batch
    stop: tuple[str, ...] = ()    # stop strings, matched on detokenized text
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None   # None = off; k >= 0: the sampled token's logprob + top-k
    constraint: Constraint | None = None   # structured output: what the text must match

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name}={getattr(self, name)!r}: {why}")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and 0 <= self.temperature <= 100):
            bad("temperature", "must be between 0 and 100")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_INT32:
            bad("top_k", f"must be an integer in [0, {MAX_INT32}] (0 = off)")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                bad(name, "must be between -2 and 2")
        if self.logprobs is not None and not (_is_int(self.logprobs)
                                              and 0 <= self.logprobs <= 20):
            bad("logprobs", "must be an integer between 0 and 20")
        if self.seed is not None and not _is_int(self.seed):
            bad("seed", "must be an integer or None")
        if len(self.stop) > 16 or any(not s for s in self.stop):
            bad("stop", "at most 16 non-empty strings")


# argmax, no seed: the sampling of plan rows that sample nothing, and of rows made by hand
GREEDY = SamplingParams(temperature=0.0)


class ContextLengthExceeded(ValueError):
    """A prompt, or prompt + max_tokens, past a model's context; `field` is the one at fault:
    "prompt" or the max_tokens field's name."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def checked_max_tokens(prompt_tokens: int, max_tokens: int | None, max_model_len: int, *,
                       unset: int | None = None, name: str = "max_tokens") -> int:
    """`max_tokens` checked against the room a prompt of `prompt_tokens` leaves in a context of
    `max_model_len` (prompt + max_tokens <= max_model_len), the one check every front end
    (HTTP, gRPC) makes; None: `unset`, capped to the room (None: the whole room).  `name` is
    the field the caller set it with, for the message."""
    if prompt_tokens >= max_model_len:
        raise ContextLengthExceeded(f"This model's maximum context length is {max_model_len} "
                                    f"tokens; the prompt has {prompt_tokens} tokens", "prompt")
    room = max_model_len - prompt_tokens
    if max_tokens is None:
        return room if unset is None else min(unset, room)
    if max_tokens > room:
        raise ContextLengthExceeded(f"'{name}' is too large: {max_tokens} > {room} (this "
                                    f"model's maximum context length is {max_model_len} tokens "
                                    f"and the prompt has {prompt_tokens})", name)
    return max_tokens


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tier: Tier = Tier.FREE
    priority: int = 0             # within a tier; higher first
    tenant: str = ""              # salts prefix-cache hashes: no cross-tenant sharing
    deadline: float | None = None  # absolute monotonic time, for priority
    arrival_time: float = 0.0
    speculative: bool = True      # may verify draft tokens, where the model speculates
    # Tokens already generated elsewhere (a prefill worker's first token, serving/disagg/):
    # the engine takes them as the output so far, streams only what follows, and counts them
    # in max_tokens and usage.
    output_token_ids: tuple[int, ...] = ()
    # Its output continues on another engine (a prefill worker's part of a split request): a
    # length finish keeps the text held back (detokenizer, stop strings) unsent, as the
    # engine that continues emits it.
    continues: bool = False


@dataclass(frozen=True)
class KVHandoff:
    """What fetching a resumed request's prompt KV from another worker moved."""
    blocks: int
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    num_draft_tokens: int = 0      # speculative drafts verified for the request (not OpenAI's)
    num_accepted_tokens: int = 0   # of those, accepted

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class EngineEvent:
    request_id: str
    token_ids: tuple[int, ...] = ()
    text: str = ""                              # the text delta these tokens add
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None            # stop | length | abort | error
    usage: Usage | None = None                  # on the final event
    error: str | None = None
    kv_handoff: KVHandoff | None = None         # on a resumed request's first event

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
