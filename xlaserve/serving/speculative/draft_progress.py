"""How far a draft model's KV cache has followed each request, and what one proposal asks.

The draft model keeps its own paged KV cache on device, addressed through the target's block
tables (the same block ids and slots, another array: vLLM v1 lays its EAGLE and draft-model
caches out the same way), so a block the target frees, trims or preempts is gone for the draft
too and no second pool can leak.  What the host must track is which positions of a request
hold draft KV computed from the tokens the request really has:

    tokens      [p p p p t]          t: the last sampled token; the target computed p p p p
    proposal    draft feeds tokens[computed:] then d1 .. d(k-1), sampling d1 .. dk
                computed -> len(tokens) + k - 1
    verify      target accepts a drafts, emits its own token after them
                computed -> min(computed, target's num_computed_tokens)   (settle)

Positions below the target's num_computed_tokens hold accepted tokens only, so the draft's KV
there is right exactly up to min(computed, num_computed); what lies past it is rewritten by
the next proposal, which starts at `computed` (after an accepted bonus token, or decode steps
taken without drafts, it feeds more than one token).  A preempted request's blocks are gone:
it starts again at 0, as does a new request on a prefix hit (the draft never wrote a shared
block it did not compute itself; rewriting it writes the same values).

Plain Python, no jax.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from xlaserve.serving.types import GREEDY, SamplingParams


@dataclass(frozen=True)
class DraftQuery:
    """One row's proposal request: draft `limit` tokens after `token_ids` (all known; the last
    is the row's input), the draft's KV valid for positions [0, start), block table and slots
    reserved for every position the draft writes (through len(token_ids) + limit - 2), and
    how the request samples: draft j is drawn with `sampling` at output index
    len(token_ids) - num_prompt_tokens + j (its seed salted by the proposer)."""

    request_id: str
    token_ids: tuple[int, ...]
    start: int
    block_table: tuple[int, ...]
    limit: int
    sampling: SamplingParams = GREEDY
    num_prompt_tokens: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.start < len(self.token_ids):
            raise ValueError(f"{self.request_id}: draft start {self.start} outside "
                             f"[0, {len(self.token_ids)})")
        if self.limit < 1:
            raise ValueError(f"{self.request_id}: draft limit {self.limit} < 1")


class BatchProposer(Protocol):
    """A proposer that drafts for a step's rows at once (a draft model: one device call per
    draft position for all rows).  It returns exactly `limit` tokens per query, in order."""

    def propose_batch(self, queries: Sequence[DraftQuery]) -> list[tuple[int, ...]]: ...


class DraftProgress:
    """Per running request: positions [0, computed) of the draft's cache are valid."""

    def __init__(self) -> None:
        self._computed: dict[str, int] = {}

    def start(self, request_id: str, num_computed_tokens: int) -> int:
        """Where the next proposal starts feeding (never past what the target computed)."""
        return min(self._computed.get(request_id, 0), num_computed_tokens)

    def proposed(self, query: DraftQuery) -> None:
        """The draft ran `query`: it wrote every position up to its last draft's input."""
        self._computed[query.request_id] = len(query.token_ids) + query.limit - 1

    def settle(self, request_id: str, num_computed_tokens: int) -> None:
        """After verification: only the accepted prefix stays valid."""
        if request_id in self._computed:
            self._computed[request_id] = min(self._computed[request_id], num_computed_tokens)

    def forget(self, request_id: str) -> None:
        """Finished, aborted or preempted: its blocks (and the draft's KV in them) are gone."""
        self._computed.pop(request_id, None)

    def computed(self, request_id: str) -> int:
        return self._computed.get(request_id, 0)

    def check_integrity(self, held: Mapping[str, int]) -> None:
        """`held`: KV slots each running request holds in the pool.  Every tracked request is
        running, and its draft KV lies within the slots it holds."""
        stray = sorted(set(self._computed) - set(held))
        assert not stray, f"draft progress for requests not running: {stray}"
        for rid, n in self._computed.items():
            assert 0 <= n <= held[rid], f"{rid}: draft KV through {n}, holds {held[rid]} slots"
