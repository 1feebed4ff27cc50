"""Host-side output state of one request: detokenizer, stop strings, logprobs, penalties."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from xlaserve.serving.engine.stop_strings import StopStringMatcher
from xlaserve.serving.structured.grammar import GrammarState
from xlaserve.serving.tokenizer import IncrementalDetokenizer, Tokenizer
from xlaserve.serving.types import EngineEvent, GenerationRequest, TokenLogprob


@dataclass
class OutputState:
    request: GenerationRequest
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    stop_ids: frozenset[int]
    vocab_size: int
    output_ids: list[int] = field(default_factory=list)
    counts: dict[int, int] = field(default_factory=dict)
    grammar: GrammarState | None = None   # a constrained request's position in its grammar

    @classmethod
    def create(cls, request: GenerationRequest, tokenizer: Tokenizer,
               eos_ids: tuple[int, ...], vocab_size: int,
               grammar: GrammarState | None = None) -> "OutputState":
        s = request.sampling
        stop_ids = frozenset(s.stop_token_ids) | (frozenset() if s.ignore_eos
                                                  else frozenset(eos_ids))
        state = cls(request, IncrementalDetokenizer(tokenizer, request.prompt_token_ids),
                    StopStringMatcher(s.stop), stop_ids, vocab_size, grammar=grammar)
        for token in request.output_token_ids:   # generated elsewhere: taken, not streamed
            _, reason = state.accept(token, None)
            if reason is not None:
                raise ValueError(f"request {request.request_id!r}: its output_token_ids end "
                                 f"it already ({reason} at token {token})")
        return state

    @property
    def uses_penalties(self) -> bool:
        s = self.request.sampling
        return s.presence_penalty != 0 or s.frequency_penalty != 0

    def penalty_bias(self) -> np.ndarray | None:
        """[V] additive bias from the generated tokens so far, or None."""
        if not self.uses_penalties or not self.counts:
            return None
        s = self.request.sampling
        ids = np.fromiter(self.counts.keys(), np.int64)
        cnt = np.fromiter(self.counts.values(), np.float32)
        bias = np.zeros(self.vocab_size, np.float32)
        bias[ids] = -(s.presence_penalty + s.frequency_penalty * cnt)
        return bias

    def accept(self, token: int, logprob: TokenLogprob | None) -> tuple[EngineEvent, str | None]:
        """Take one sampled token: the event to stream and a finish reason if it ends here.
        The one place a request's grammar advances (per accepted token): a grammar that
        rejects the token ends the request with "error" (its mask should have forbidden it),
        one that allows nothing more but end-of-sequence ends it with "stop"."""
        rid = self.request.request_id
        self.output_ids.append(token)
        self.counts[token] = self.counts.get(token, 0) + 1
        lps = (logprob,) if logprob is not None else ()
        if self.grammar is not None and not self.grammar.accept(token):
            return EngineEvent(rid, (token,), self.flush_text()[0], lps), "error"
        if token in self.stop_ids:   # the stop token's own text is not part of the output
            return EngineEvent(rid, (token,), self.flush_text()[0], lps), "stop"
        text, stopped = self.stops.feed(self.detok.add(token))
        if stopped:
            return EngineEvent(rid, (token,), text, lps), "stop"
        if self.grammar is not None and self.grammar.done:
            return EngineEvent(rid, (token,), text + self.flush_text()[0], lps), "stop"
        return EngineEvent(rid, (token,), text, lps), None

    def flush_text(self) -> tuple[str, bool]:
        """At the end of the stream: the text still held back (by the detokenizer, then by the
        stop-string matcher), cut before a stop string it completes; and whether it did."""
        text, stopped = self.stops.feed(self.detok.flush())
        return (text, True) if stopped else (text + self.stops.flush(), False)
