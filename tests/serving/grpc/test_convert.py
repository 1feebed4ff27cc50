"""Sampling parameters survive the trip through protobuf, an output constraint included (a
worker must enforce the constraint the front end checked); so do a request's speculation
opt-out, its draft counters in usage and the engine's in its stats."""

from __future__ import annotations

from xlaserve.serving.engine_api import EngineStats, ServiceCosts
from xlaserve.serving.grpc.convert import (
    event_from_pb,
    event_to_pb,
    request_to_pb,
    sampling_from_pb,
    sampling_to_pb,
    speculative_from_pb,
    stats_from_pb,
    stats_to_pb,
)
from xlaserve.serving.structured.constraint import Constraint
from xlaserve.serving.types import EngineEvent, GenerationRequest, SamplingParams, Usage


def test_sampling_round_trips_with_and_without_a_constraint() -> None:
    for constraint in (None, Constraint.json_schema({"type": "object"}),
                       Constraint("regex", "[0-9]+"), Constraint.choice(["a", "b"]),
                       Constraint("lark", 'start: "x"')):
        s = SamplingParams(max_tokens=7, temperature=0.5, seed=3, stop=("z",),
                           constraint=constraint)
        assert sampling_from_pb(sampling_to_pb(s)) == s


def test_speculative_opt_out_usage_and_stats_counters_round_trip() -> None:
    for flag in (True, False):
        m = request_to_pb(GenerationRequest("r", [1, 2], speculative=flag), "m")
        assert speculative_from_pb(m) is flag
    assert speculative_from_pb(request_to_pb(GenerationRequest("r", [1]), "m")) is True
    ev = EngineEvent("r", (4, 5), "ab", finish_reason="length", usage=Usage(2, 2, 0, 6, 4))
    assert event_from_pb(event_to_pb(ev)).usage == Usage(2, 2, 0, 6, 4)
    stats = EngineStats(spec_num_drafts=3, spec_num_draft_tokens=9, spec_num_accepted_tokens=5,
                        spec_acceptance_counts=(1, 0, 1, 1))
    assert stats_from_pb(stats_to_pb(stats, ServiceCosts(), True)) == stats
