"""Which prefill worker a prompt goes to: prefix-aware, then load-aware, as SGLang's
cache-aware router does (approximately: the router never sees a worker's evictions, so a
remembered prefix may be gone, which costs that worker a recomputation like any miss).

    prompt   [b0 b1 b2 b3 | tail]        chained hashes h0 h1 h2 h3 (h2 names b0..b2)
    seen     h0 -> A, h1 -> A, h2 -> A   the longest remembered: h2 -> A, 3 of 4 blocks
    choose   A, if 3/4 >= MIN_MATCH and load(A) <= least load + slack
             else the least loaded (ties in turn: unrelated prompts spread)
    record   h0 .. h3 -> the chosen worker (most recent last; the oldest forgotten past
             `capacity` hashes)

Host bookkeeping only: workers are keys (their targets), loads are the caller's numbers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from xlaserve.serving.kv_cache.block_hash import prefix_block_hashes

MIN_MATCH = 0.5     # share of the prompt's full blocks a remembered prefix must cover


class PrefixAffinity:
    """Which worker last prefilled which block-hash chains: an LRU of at most `capacity`
    hashes, each naming one worker."""

    def __init__(self, block_size: int = 16, capacity: int = 1 << 16, slack: int = 2):
        if block_size < 1 or capacity < 1 or slack < 0:
            raise ValueError(f"block_size={block_size}, capacity={capacity} must be >= 1 and "
                             f"slack={slack} >= 0")
        self.block_size = block_size
        self.capacity = capacity
        self.slack = slack        # requests more than the least loaded a prefix may cost
        self._owner: OrderedDict[bytes, str] = OrderedDict()
        self._turn = 0

    def __len__(self) -> int:
        return len(self._owner)

    def hashes(self, token_ids: Sequence[int], tenant: str) -> list[bytes]:
        """The chained hashes of the prompt's full blocks before any placeholder (negative)
        id, under `tenant`'s salt."""
        cut = next((i for i, t in enumerate(token_ids) if t < 0), len(token_ids))
        return prefix_block_hashes(token_ids[:cut], self.block_size, tenant)

    def match(self, hashes: Sequence[bytes]) -> tuple[str | None, int]:
        """The worker remembered for the longest leading run of `hashes`, and its length."""
        for n in range(len(hashes), 0, -1):
            owner = self._owner.get(hashes[n - 1])
            if owner is not None:
                return owner, n
        return None, 0

    def choose(self, workers: Sequence[str], loads: Sequence[int],
               hashes: Sequence[bytes]) -> str:
        """One of `workers` (their current `loads`, in requests) for a prompt whose full
        blocks hash to `hashes`."""
        if not workers or len(workers) != len(loads):
            raise ValueError(f"{len(workers)} workers with {len(loads)} loads")
        least = min(loads)
        owner, n = self.match(hashes)
        if owner in workers and n >= MIN_MATCH * len(hashes):
            if loads[workers.index(owner)] <= least + self.slack:
                return owner
        tied = [w for w, load in zip(workers, loads) if load == least]
        self._turn += 1
        return tied[self._turn % len(tied)]

    def record(self, worker: str, hashes: Sequence[bytes]) -> None:
        """`worker` now holds the blocks `hashes` name (it prefilled that prompt)."""
        for h in hashes:
            self._owner[h] = worker
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
