"""The step plan: the only thing the scheduler hands the runner, plain frozen data.

    StepPlan.decodes   rows of exactly one token that sample (the decode bucket)
    StepPlan.prefills  every other row: prompt chunks, a last chunk samples

Row r feeds token_ids at positions start_position .. end_position - 1, writes their KV to
slot_mapping (block_id * block_size + offset), attends over block_table, and when `sample`,
samples the token for position end_position. A token equal to PENDING_TOKEN is the token this
request sampled in the previous step, still on device: the runner substitutes it.

A verify row (speculative decoding) feeds its last sampled token and then `num_draft` proposed
tokens: [t, d1 .. dk] at positions p .. p + k.  Every one of its positions samples (the runner
gives it k + 1 sample rows); `sample_position` (p + 1) is still where its first sampled token
goes, and the scheduler keeps the drafts the target model agrees with (speculative/).
`slot_mapping()` (models/kv_slots.py) is the one place that turns positions into cache slots.

How a row samples travels with it, typed: `sampling` is its request's SamplingParams (GREEDY
for a row that samples nothing), `sample_index` the index within the request's output of the
first token it samples, which is the position in the request's seeded RNG stream (a verify
row's later samples take sample_index + 1, + 2, ...).  The runner lays both out as they are
(runner/host_step.py); nothing between the scheduler and the sampler rewrites them.
"""

from __future__ import annotations

from dataclasses import dataclass

from xlaserve.serving.types import GREEDY, SamplingParams

PENDING_TOKEN = -1  # a sampled token the host has not seen yet; the runner substitutes it


@dataclass(frozen=True)
class ScheduledSeq:
    request_id: str
    token_ids: tuple[int, ...]       # [num_tokens] input ids; PENDING_TOKEN = previous sample
    start_position: int              # position of token_ids[0] = tokens already in the cache
    block_table: tuple[int, ...]     # [num_blocks] physical block ids, covers end_position
    slot_mapping: tuple[int, ...]    # [num_tokens] cache slot of each input token
    sample: bool                     # this row's last token completes the sequence: sample
    num_draft: int = 0               # trailing draft tokens of token_ids (a verify row), each
                                     # sampled after too; 0 for every other row
    sampling: SamplingParams = GREEDY  # the request's parameters when `sample`, else GREEDY
    sample_index: int = 0            # output index of the (first) token sampled: the RNG
                                     # stream position (sample_position - prompt tokens); 0
                                     # for a row that samples nothing

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_position(self) -> int:
        """Tokens in the cache after this step (the row's kv_len)."""
        return self.start_position + len(self.token_ids)

    @property
    def sample_position(self) -> int:
        """Index in all_token_ids of the (first) token this row samples."""
        return self.end_position - self.num_draft

    @property
    def num_samples(self) -> int:
        """Tokens the row samples: 0, 1, or 1 + num_draft for a verify row."""
        return (1 + self.num_draft) if self.sample else 0

    @property
    def draft_token_ids(self) -> tuple[int, ...]:
        return self.token_ids[len(self.token_ids) - self.num_draft:]


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    decodes: tuple[ScheduledSeq, ...] = ()
    prefills: tuple[ScheduledSeq, ...] = ()
    preempted: tuple[str, ...] = ()  # request ids preempted (blocks freed) by this step

    @property
    def rows(self) -> tuple[ScheduledSeq, ...]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def num_samples(self) -> int:
        """Sample rows of the step: one per sampling row, 1 + k per verify row."""
        return sum(r.num_samples for r in self.rows)

    @property
    def sampling_ids(self) -> tuple[str, ...]:
        return tuple(r.request_id for r in self.rows if r.sample)
