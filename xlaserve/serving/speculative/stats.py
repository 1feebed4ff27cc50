"""Counters of what speculation proposed and what was accepted (vLLM's spec_decode_* names)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class SpecStats:
    num_drafts: int = 0            # verify rows (a row with >= 1 draft token) run
    num_draft_tokens: int = 0      # draft tokens proposed and verified
    num_accepted_tokens: int = 0   # of those, accepted
    # acceptance_counts[a]: verify rows that accepted exactly a drafts (a = 0 .. k)
    acceptance_counts: list[int] = field(default_factory=list)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        assert 0 <= num_accepted <= num_drafts, (num_accepted, num_drafts)
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        while len(self.acceptance_counts) <= num_accepted:
            self.acceptance_counts.append(0)
        self.acceptance_counts[num_accepted] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify row emits on average: the accepted drafts plus the target's own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def snapshot(self) -> SpecStats:
        return replace(self, acceptance_counts=list(self.acceptance_counts))
