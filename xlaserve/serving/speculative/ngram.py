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
        for n in range(min(c.prompt_lookup_max, size - 1), c.prompt_lookup_min - 1, -1):
            suffix = tokens[size - n:]                                       # [n]
            # windows[i] = tokens[i:i+n] for every start i whose n-gram ends before the suffix
            # starts to overlap its own end: i + n < size, so a token follows the match
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:size - 1], n)
            hits = np.flatnonzero(np.all(windows == suffix, axis=1))        # starts, ascending
            if hits.size:
                start = int(hits[-1]) + n                                    # first token after
                return tuple(int(t) for t in tokens[start:start + k])
        return ()
