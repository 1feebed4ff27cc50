"""Sampling parameters survive the trip through protobuf, an output constraint included (a
worker must enforce the constraint the front end checked)."""

from __future__ import annotations

from xlaserve.serving.grpc.convert import sampling_from_pb, sampling_to_pb
from xlaserve.serving.structured.constraint import Constraint
from xlaserve.serving.types import SamplingParams


def test_sampling_round_trips_with_and_without_a_constraint() -> None:
    for constraint in (None, Constraint.json_schema({"type": "object"}),
                       Constraint("regex", "[0-9]+"), Constraint.choice(["a", "b"]),
                       Constraint("lark", 'start: "x"')):
        s = SamplingParams(max_tokens=7, temperature=0.5, seed=3, stop=("z",),
                           constraint=constraint)
        assert sampling_from_pb(sampling_to_pb(s)) == s
