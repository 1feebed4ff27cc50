"""How a served model speculates: `[models] engine_args.speculative` (off when absent).

    engine_args = { ..., speculative = { method = "ngram", num_speculative_tokens = 4,
                                         prompt_lookup_max = 4, prompt_lookup_min = 2 } }

The names are vLLM's.  A request opts out with `"speculative": false` in its body
(GenerationRequest.speculative)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4   # k: draft tokens verified per row and step at most
    prompt_lookup_max: int = 4        # longest suffix n-gram looked up
    prompt_lookup_min: int = 2        # shortest; below it no proposal

    def __post_init__(self) -> None:
        def bad(why: str) -> None:
            raise ValueError(f"SpeculativeConfig: {why}")

        if self.method not in METHODS:
            bad(f"method={self.method!r}: choose from {METHODS}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                bad(f"{name}={value!r} must be an integer >= 1")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            bad(f"prompt_lookup_min={self.prompt_lookup_min} > prompt_lookup_max="
                f"{self.prompt_lookup_max}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SpeculativeConfig:
        """From a TOML table; an unknown key is a ValueError naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"speculative: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(data))
