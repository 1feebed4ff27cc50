"""What a request's output must match: a `Constraint`, as the front ends parse it from
`response_format`, `guided_*` / `structured_outputs` and `tool_choice`, carried in
`SamplingParams` to the engine, which compiles it (grammar.py).  Plain data: no grammar
engine is imported here, so the types, the scheduler's tests and gRPC can carry it."""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "regex", "choice", "lark")
MAX_SPEC_CHARS = 64 * 1024   # a schema / regex / grammar longer than this is refused


@dataclass(frozen=True)
class Constraint:
    """`kind`: json (spec: a JSON schema as JSON text, "" = any JSON object), regex (a
    regular expression the whole output matches), choice (a JSON list of the allowed
    strings), lark (a context-free grammar in llguidance's Lark dialect, or GBNF: rules
    written `name ::= ...`)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind {self.kind!r}: must be one of {list(KINDS)}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"constraint of {len(self.spec)} characters exceeds the limit of "
                             f"{MAX_SPEC_CHARS}")

    @classmethod
    def json_schema(cls, schema: dict | bool | None) -> Constraint:
        """Any JSON object (None), or the instances of `schema`."""
        return cls("json", "" if schema is None else json.dumps(schema))

    @classmethod
    def choice(cls, options: list[str]) -> Constraint:
        return cls("choice", json.dumps(options))
