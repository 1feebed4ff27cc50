"""What the router knows each replica holds in its prefix cache: the chained hashes of the full
KV blocks of the prompts it sent there, most recent last, bounded like the cache itself; and,
over a whole model group, how many routed prompts each block was in (a system prompt's blocks
are in most of them: `PrefixIndex.shared`).

    prompt ids [t0 .. t15 | t16 .. t31 | t32 .. t34]      block_size 16, tenant "acme"
    block_chain -> [h1, h2]          h1 = H(salt(tenant), t0..t15),  h2 = H(h1, t16..t31)
                                     (the partial block t32.. is not cacheable: not hashed)
    PrefixIndex.matched([h1, h2, h3]) -> 2 when h1 and h2 were added (a chain hash names its
                                     whole prefix, so the first miss ends the match)

A conversation's next turn extends its previous prompt, so its chain starts with the previous
turn's hashes and matches where that turn went past the shared blocks, however long either
turn is; prompts that share only a system prompt match nothing past them, and the router
places them by load.  The index is the router's own record (no RPC); a replica's evictions
are not seen, only approximated by forgetting the least recently used hashes past `capacity`.
Hashes are Python's `hash` of tuples: fast and only ever compared within this process.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def block_chain(prompt_ids: Sequence[int], tenant: str, block_size: int,
                max_blocks: int) -> list[int]:
    """Chained hashes of the prompt's first full blocks (at most `max_blocks`), salted by
    tenant as the engines' prefix caches are (one tenant never matches another's prefix)."""
    n = min(len(prompt_ids) // block_size, max_blocks)
    h = hash(("tenant", tenant))
    out = []
    for i in range(n):
        h = hash((h, tuple(prompt_ids[i * block_size:(i + 1) * block_size])))
        out.append(h)
    return out


class PrefixIndex:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"PrefixIndex capacity={capacity}: must be >= 1")
        self.capacity = capacity
        self._seen: OrderedDict[int, int] = OrderedDict()   # hash -> times added; LRU order

    def __len__(self) -> int:
        return len(self._seen)

    def matched(self, chain: Sequence[int], at_least: int = 1) -> int:
        """How many leading blocks of `chain` were added (at least `at_least` times): for a
        replica's index, the blocks it was sent and may still hold."""
        return next((i for i, h in enumerate(chain) if self._seen.get(h, 0) < at_least),
                    len(chain))

    def shared(self, chain: Sequence[int], at_least: int) -> int:
        """For the group-wide index: how many leading blocks of `chain` were in `at_least`
        routed prompts (a prefix most prompts share)."""
        return self.matched(chain, at_least)

    def add(self, chain: Sequence[int]) -> None:
        """Record the blocks of `chain` (now the most recent; each counted once more),
        forgetting the least recently used beyond `capacity`."""
        for h in chain:
            self._seen[h] = self._seen.get(h, 0) + 1
            self._seen.move_to_end(h)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
