"""One step under construction (`Scheduler.schedule`): the tokens given to each sequence in
scheduling order, the budget left, the sequences preempted and the verify rows' drafts.
`Scheduler._emit` turns it into the StepPlan."""

from __future__ import annotations

from dataclasses import dataclass, field

from xlaserve.serving.scheduler.sequence import Sequence


@dataclass
class StepBuilder:
    """One step under construction: tokens per sequence, in scheduling order."""

    budget: int
    entries: dict[str, tuple[Sequence, int]] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    drafts: dict[str, tuple[int, ...]] = field(default_factory=dict)  # verify rows' drafts

    def add(self, seq: Sequence, n: int) -> None:
        self.entries[seq.request_id] = (seq, n)
        self.budget -= n

    def drop(self, seq: Sequence) -> None:
        """`seq` was preempted: give back what it was given this step."""
        self.preempted.append(seq.request_id)
        entry = self.entries.pop(seq.request_id, None)
        if entry is not None:
            self.budget += entry[1]
