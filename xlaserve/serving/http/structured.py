"""The request fields that constrain the output, read into one `Constraint`:

    response_format      {"type": "text"} | {"type": "json_object"}
                         | {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    guided_json / guided_regex / guided_choice / guided_grammar     (vLLM's extensions)
    structured_outputs   {"json" | "regex" | "choice" | "grammar": ..., or "json_object": true}
                         (vLLM's newer object)

At most one of them may constrain a request (and tool_choice "required" / a named function,
http/tools.py, is one too).  Here only the shapes are checked; whether the schema, regex or
grammar compiles is checked against the model's tokenizer in `pipeline.sampling_params`,
before anything is queued (a 400 naming the field).
"""

from __future__ import annotations

import json
from typing import Any

from xlaserve.serving.http.errors import ApiError, invalid_value
from xlaserve.serving.structured.constraint import MAX_SPEC_CHARS, Constraint

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "structured_outputs", "response_format")
MAX_CHOICES = 1024


def _schema(v: Any, param: str) -> Constraint:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError as e:
            raise invalid_value(param, f"not valid JSON ({e.msg})") from None
    if not isinstance(v, (dict, bool)):
        raise invalid_value(param, f"a JSON schema must be an object, got {type(v).__name__}")
    c = Constraint.json_schema(v)
    if len(c.spec) > MAX_SPEC_CHARS:
        raise invalid_value(param, f"the schema has {len(c.spec)} characters, over the limit "
                                   f"of {MAX_SPEC_CHARS}")
    return c


def _text(v: Any, param: str, kind: str) -> Constraint:
    if not isinstance(v, str) or not v:
        raise invalid_value(param, "must be a non-empty string")
    if len(v) > MAX_SPEC_CHARS:
        raise invalid_value(param, f"{len(v)} characters, over the limit of {MAX_SPEC_CHARS}")
    return Constraint(kind, v)


def _choice(v: Any, param: str) -> Constraint:
    if not isinstance(v, list) or not v or not all(isinstance(x, str) and x for x in v):
        raise invalid_value(param, "must be a non-empty list of non-empty strings")
    if len(v) > MAX_CHOICES:
        raise invalid_value(param, f"{len(v)} choices, over the limit of {MAX_CHOICES}")
    return Constraint.choice(v)


# how the value of structured_outputs.<key> (and of guided_<key>) reads
_READERS = {"json": _schema, "regex": lambda v, p: _text(v, p, "regex"), "choice": _choice,
            "grammar": lambda v, p: _text(v, p, "lark")}


def _response_format(v: Any) -> Constraint | None:
    if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid_value("response_format", "'type' must be one of 'text', 'json_object', "
                                               "'json_schema'")
    if v["type"] == "text":
        return None
    if v["type"] == "json_object":
        return Constraint.json_schema(None)
    js = v.get("json_schema")
    if not isinstance(js, dict):
        raise invalid_value("response_format.json_schema", "must be an object with a 'schema'")
    if "schema" not in js:
        raise ApiError(400, "Missing required parameter: 'response_format.json_schema.schema'",
                       "response_format.json_schema.schema", "missing_required_parameter")
    return _schema(js["schema"], "response_format.json_schema.schema")


def _structured_outputs(v: Any) -> Constraint:
    if not isinstance(v, dict):
        raise invalid_value("structured_outputs", "must be an object")
    set_ = [k for k in v if v[k] not in (None, False)]
    unknown = [k for k in set_ if k not in _READERS and k != "json_object"]
    if unknown:
        raise ApiError(400, f"Unrecognized structured_outputs field(s): {unknown}",
                       "structured_outputs", "unrecognized_argument")
    if len(set_) != 1:
        raise invalid_value("structured_outputs", f"exactly one constraint must be set, got {set_}")
    k = set_[0]
    if k == "json_object":
        return Constraint.json_schema(None)
    return _READERS[k](v[k], f"structured_outputs.{k}")


def parse_constraint(body: dict[str, Any]) -> tuple[Constraint | None, str | None]:
    """The request's constraint and the field that holds it, as errors name it (None, None:
    unconstrained)."""
    found: list[tuple[Constraint, str]] = []
    for name in GUIDED_FIELDS:
        v = body.get(name)
        if v is None:
            continue
        if name == "response_format":
            c = _response_format(v)
            param = f"{name}.json_schema.schema" if v.get("type") == "json_schema" else name
        elif name == "structured_outputs":
            c = _structured_outputs(v)
            param = f"{name}.{next(k for k in v if v[k] not in (None, False))}"
        else:   # guided_json, guided_regex, guided_choice, guided_grammar
            c, param = _READERS[name.removeprefix("guided_")](v, name), name
        if c is not None:
            found.append((c, param))
    if len(found) > 1:
        names = [n for _, n in found]
        raise ApiError(400, f"Only one output constraint per request; got {names}", names[1],
                       "invalid_value")
    return found[0] if found else (None, None)
