"""Stop strings on streamed text: emit only what can no longer turn into a stop string.

Text that might be the beginning of a stop string is held back until the next delta settles
it; on a match the text is cut before the stop string and the request ends."""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped)."""
        if not self.stops:
            return delta, False
        text = self.pending + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return text[: min(hits)], True
        keep = self._partial_tail(text)
        self.pending = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out

    def _partial_tail(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for n in range(min(self.hold, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
