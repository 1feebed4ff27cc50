"""Request ids and W3C trace context.

`x-request-id` from the client is kept when it is a short printable token, else one is made.
`traceparent` (version-traceid-parentid-flags) is validated; a valid one is echoed back and its
trace id recorded; without one, a new trace id is started.  The engine request id is
`<request id>` (plus `-<choice>` when a request fans out into several engine requests).
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,96}$")
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


@dataclass(frozen=True)
class TraceContext:
    request_id: str
    trace_id: str
    traceparent: str      # what we send back / on to the engine side
    given: bool = False   # the client sent this traceparent (else it was made here)

    @classmethod
    def from_headers(cls, request_id: str | None, traceparent: str | None) -> TraceContext:
        given = traceparent.strip().lower() if traceparent else ""
        m = _TRACEPARENT.match(given)
        valid = bool(m) and m.group(2) != "0" * 32 and m.group(3) != "0" * 16 \
            and m.group(1) != "ff"
        if m and valid:
            trace_id, parent = m.group(2), given
        else:
            trace_id = secrets.token_hex(16)
            parent = f"00-{trace_id}-{secrets.token_hex(8)}-01"
        rid = request_id.strip() if request_id else ""
        if not _REQUEST_ID.match(rid):
            rid = "req-" + secrets.token_hex(12)
        return cls(rid, trace_id, parent, valid)
