"""Append-only JSONL audit log: one line per request, written when the request ends.

Fields: ts (unix seconds), request_id, trace_id, tenant, tier, model, endpoint, status,
prompt_tokens, completion_tokens, cached_tokens, latency_s, finish_reasons, error; plus `prompt`
only when the config says include_prompts.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any


def utf8_json(obj: Any, **kwargs: Any) -> bytes:
    """`obj` as UTF-8 JSON; when it holds a lone surrogate (one a client sent, as an unknown
    field's name or a "model"), which has no UTF-8 form, all non-ASCII is \\u-escaped instead,
    as the client wrote it."""
    try:
        return json.dumps(obj, ensure_ascii=False, **kwargs).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(obj, **kwargs).encode("ascii")


class AuditLog:
    def __init__(self, path: str | Path, include_prompts: bool = False):
        self.path = Path(path)
        self.include_prompts = include_prompts
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_APPEND: each line lands whole at the end even with several writers.
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        if not self.include_prompts:
            record = {k: v for k, v in record.items() if k != "prompt"}
        line = utf8_json(record, separators=(",", ":")) + b"\n"
        with self._lock:
            os.write(self._fd, line)
