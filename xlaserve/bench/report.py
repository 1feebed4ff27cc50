"""The benchmark's one table, from the systems' summary dicts (metrics.SystemResult.summary),
the Markdown table every bench report prints, and the JSON file most of them write."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLUMNS = (
    ("system", "system", "{}"),
    ("requests", "req", "{}"),
    ("output_tokens", "out tok", "{}"),
    ("wall_s", "wall s", "{:.2f}"),
    ("output_tokens_per_s", "out tok/s", "{:.1f}"),
    ("requests_per_s", "req/s", "{:.2f}"),
    ("latency_mean_s", "lat mean s", "{:.2f}"),
    ("latency_p99_s", "lat p99 s", "{:.2f}"),
    ("kv_waste", "KV waste", "{:.1%}"),
    ("kv_peak_slots", "KV peak slots", "{}"),
    ("compiles_after_warmup", "compiles", "{}"),
)


def format_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table, one row per system; missing values print as '-'."""
    head = [title for _, title, _ in COLUMNS]
    body = [[("-" if row.get(key) is None else fmt.format(row[key]))
             for key, _, fmt in COLUMNS] for row in rows]
    return markdown_table(head, body)


def write_json(path: str | Path, data: Any, indent: int = 1) -> None:
    """A bench report's JSON file, and the line on stdout that names it."""
    Path(path).write_text(json.dumps(data, indent=indent) + "\n")
    print(f"wrote {path}")


def markdown_table(head: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """`head` over the rows of `body`, every column as wide as its widest cell."""
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h)
              for i, h in enumerate(head)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(head), rule, *(line(r) for r in body)])
