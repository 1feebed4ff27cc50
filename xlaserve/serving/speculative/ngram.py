"""N-gram prompt lookup: propose what followed the last time the sequence's tail occurred.

    tokens:  [ ... a b c d e ... | ... a b c ]        suffix "a b c" (n = 3) occurred before
                       ^^^^^ proposal = "d e" (up to k tokens after the match)

The longest n in [prompt_lookup_min, prompt_lookup_max] with an earlier occurrence wins; among
occurrences of that n-gram, the most recent one (the freshest context).  No match: no proposal,
and the row decodes one token as usual.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from xlaserve.serving.speculative.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> tuple[int, ...]:
        """Up to min(k, max_tokens) draft tokens to follow `token_ids` (prompt + output so far,
        all known), or () when no suffix n-gram occurred before."""
        c = self.config
        k = min(c.num_speculative_tokens, max_tokens)
        size = len(token_ids)
        if k < 1 or size <= c.prompt_lookup_min:
            return ()
        tokens = np.asarray(token_ids, dtype=np.int64)                     # [L]
        # ends[j]: the positions i < L - 1 where an n-gram equal to the suffix of length n
        # ends, for n = 1, 2, ...: one pass for n = 1, then a filter per longer n
        ends = np.flatnonzero(tokens[:size - 1] == tokens[size - 1])
        best = -1
        for n in range(1, min(c.prompt_lookup_max, size - 1) + 1):
            if n > 1:
                ends = ends[ends >= n - 1]
                ends = ends[tokens[ends - (n - 1)] == tokens[size - n]]
            if not ends.size:
                break
            if n >= c.prompt_lookup_min:
                best = int(ends[-1])              # the most recent match of the longest n
        if best < 0:
            return ()
        return tuple(int(t) for t in tokens[best + 1:best + 1 + k])
