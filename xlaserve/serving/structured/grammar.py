"""Grammars on llguidance: a `Constraint` compiled for one tokenizer, and the per-request
state that says which tokens may come next.

    Constraint --GrammarCompiler.start--> GrammarState (checked, bounded), one per request
                                          (each choice of n):
        fill(mask)      the packed allowed-token bitmask for the next token   [ceil(V/32)] int32
                        (bit t % 32 of word t // 32 set = token t allowed)
        accept(token)   advance by one sampled token: the one place the state moves
        done            nothing but end-of-sequence may follow (the request ends)
        rollback(k)     undo the last k accepted tokens (for speculative decoding)

Why llguidance: BENCHMARKS.md "Grammar engine" (its masks cost ~10 us a token on SmolLM2's
49152-token vocabulary, like outlines-core's, but a grammar compiles in under a millisecond
instead of ~100 ms, it takes context-free grammars, and it rolls back); no torch needed.
A grammar the engine cannot build within `LLParserLimits` is refused with the engine's
reason, which names the bound.
"""

from __future__ import annotations

import json
import time

import numpy as np

from xlaserve.serving.structured.constraint import Constraint
from xlaserve.serving.tokenizer import Tokenizer

# JSON the model writes: ", " and ": " between items, no other whitespace (free whitespace lets
# a small model pad forever); strings and numbers as the schema says.
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
COMPILE_BUDGET_S = 2.0   # a grammar whose first mask takes longer than this is refused


class GrammarError(ValueError):
    """A constraint that cannot be compiled: bad schema, regex or grammar, or over a bound."""


def words(vocab_size: int) -> int:
    """int32 words of a packed mask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


class GrammarCompiler:
    """Compiles constraints for one tokenizer (its llguidance vocabulary is built once, ~0.2 s,
    at the first compile) over `vocab_size` model tokens (>= the tokenizer's; the padding ids
    are never allowed)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll_tokenizer = None

    def _llt(self):  # -> llguidance.LLTokenizer
        if self._ll_tokenizer is None:
            import llguidance

            text = self.tokenizer.to_json()
            if text is None:
                raise GrammarError("structured outputs need a BPE tokenizer (tokenizer.json); "
                                   f"this model's is {self.tokenizer.kind}")
            self._ll_tokenizer = llguidance.LLTokenizer(
                text, n_vocab=self.vocab_size, eos_token=list(self.tokenizer.eos_ids))
        return self._ll_tokenizer

    def grammar(self, c: Constraint) -> str:
        """The llguidance grammar text of `c` (not yet checked)."""
        import llguidance

        m = llguidance.LLMatcher
        if c.kind == "json":
            try:
                schema = json.loads(c.spec) if c.spec else {"type": "object"}
            except json.JSONDecodeError as e:
                raise GrammarError(f"schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError(f"schema must be a JSON object, got {type(schema).__name__}")
            try:
                return m.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            except ValueError as e:
                raise GrammarError(f"invalid schema: {e}") from None
        if c.kind == "regex":
            return m.grammar_from_regex(c.spec)
        if c.kind == "choice":
            options = json.loads(c.spec)
            return m.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
        if "::=" in c.spec:   # GBNF (llama.cpp's, vLLM's guided_grammar EBNF)
            try:
                return m.grammar_from_lark(llguidance.gbnf_to_lark(c.spec))
            except Exception as e:  # noqa: BLE001 (the converter's own error types)
                raise GrammarError(f"invalid GBNF grammar: {e}") from None
        return m.grammar_from_lark(c.spec)

    def start(self, c: Constraint) -> GrammarState:
        """A fresh state of `c` for one request: GrammarError with llguidance's reason when `c`
        is invalid or exceeds the parser's limits (grammar size, lexer states, per-step
        fuel), or when building it and its first mask takes over COMPILE_BUDGET_S.  The front
        end calls it once to check a request before queueing it; the engine once per choice."""
        import llguidance

        grammar = self.grammar(c)
        begin = time.perf_counter()
        # llguidance's default limits, but no verbose errors (they would echo parser
        # internals to clients)
        limits = llguidance.LLParserLimits(verbose_errors=False)
        matcher = llguidance.LLMatcher(self._llt(), grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise GrammarError(_reason(matcher.get_error()))
        state = GrammarState(matcher, self.vocab_size)
        mask = np.zeros(words(self.vocab_size), np.int32)
        state.fill(mask)   # the first mask builds most of the lexer
        took = time.perf_counter() - begin
        if matcher.is_error():
            raise GrammarError(_reason(matcher.get_error()))
        if took > COMPILE_BUDGET_S:
            raise GrammarError(f"the grammar took {took:.1f} s to compile, over the bound of "
                               f"{COMPILE_BUDGET_S:g} s")
        if not mask.any():
            raise GrammarError("the grammar allows no output at all")
        return state


def _reason(error: str) -> str:
    return " ".join(error.split())[:500] or "invalid grammar"


class GrammarState:
    """One request's position in its grammar (an llguidance LLMatcher)."""

    def __init__(self, matcher, vocab_size: int):
        self._m = matcher
        self.vocab_size = vocab_size
        self.accepted = 0   # tokens accepted so far

    def fill(self, mask: np.ndarray) -> None:
        """Write the next token's allowed set into `mask` [ceil(V/32)] int32 (C-contiguous)."""
        assert mask.dtype == np.int32 and mask.flags.c_contiguous and \
            mask.shape == (words(self.vocab_size),), (mask.dtype, mask.shape)
        self._m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar rejects it (the state is then
        in error and `done`)."""
        ok = bool(self._m.consume_token(token))
        self.accepted += ok
        return ok

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if not 0 <= num_tokens <= self.accepted or not self._m.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} of {self.accepted} tokens")
        self.accepted -= num_tokens

    @property
    def done(self) -> bool:
        """Nothing but end-of-sequence may follow (or the state is in error)."""
        return bool(self._m.is_stopped() or self._m.is_error())
