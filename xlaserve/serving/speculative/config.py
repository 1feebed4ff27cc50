"""How a served model speculates: `[models] engine_args.speculative` (off when absent).

    engine_args = { ..., speculative = { method = "ngram", num_speculative_tokens = 4,
                                         prompt_lookup_max = 4, prompt_lookup_min = 2 } }
    engine_args = { ..., speculative = { method = "draft", num_speculative_tokens = 3,
                                         draft_layers = 8 } }        # the model's first 8 layers
    engine_args = { ..., speculative = { method = "draft", draft_model = "/models/small" } }

"ngram" looks the drafts up in the request's own tokens (ngram.py); "draft" runs a smaller
model with the same tokenizer (a checkpoint folder, `draft_model`, or the served model's own
first `draft_layers` layers under its final norm and head; both: that folder's first layers).
The names are vLLM's where it has them.  A request opts out with `"speculative": false` in its
body (GenerationRequest.speculative)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4   # k: draft tokens verified per row and step at most
    prompt_lookup_max: int = 4        # longest suffix n-gram looked up
    prompt_lookup_min: int = 2        # shortest; below it no proposal
    draft_model: str | None = None    # "draft": a checkpoint folder (same tokenizer)
    draft_layers: int | None = None   # "draft": keep only the first N layers of the draft

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
        if self.draft_layers is not None and (
                not isinstance(self.draft_layers, int) or isinstance(self.draft_layers, bool)
                or self.draft_layers < 1):
            bad(f"draft_layers={self.draft_layers!r} must be an integer >= 1")
        if self.draft_model is not None and not isinstance(self.draft_model, str):
            bad(f"draft_model={self.draft_model!r} must be a folder path")
        if self.method == "draft" and self.draft_model is None and self.draft_layers is None:
            bad("method='draft' needs draft_model (a checkpoint folder) or draft_layers (the "
                "served model's first N layers as its own draft)")
        if self.method == "ngram" and (self.draft_model, self.draft_layers) != (None, None):
            bad(f"draft_model={self.draft_model!r} / draft_layers={self.draft_layers!r} are "
                "for method='draft', not 'ngram'")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SpeculativeConfig:
        """From a TOML table; an unknown key is a ValueError naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"speculative: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(data))
