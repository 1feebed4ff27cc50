"""A clock the test sets by hand (`clock.t += 0.5`), for code that takes `clock=` (no jax)."""

from __future__ import annotations


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
