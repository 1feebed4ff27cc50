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
        try:
            line = (json.dumps(record, ensure_ascii=False, separators=(",", ":"))
                    + "\n").encode()
        except UnicodeEncodeError:  # a lone surrogate the client sent (as "model", say)
            line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
