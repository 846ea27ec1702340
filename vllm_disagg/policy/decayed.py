"""A quantity per second over a sliding exponential window: the one decayed accumulator the policies share.

Each ``add(now, amount)`` contributes ``amount / window_s`` and decays with time constant ``window_s``, so a steady
stream of amounts reads as their rate per second (events per second for amounts of 1, a busy share for amounts in
seconds). Pure: the caller passes the clock, so a simulator replays it in simulated time.
"""

from __future__ import annotations

import math


class DecayedRate:
    """An exponentially decayed sum of amounts per second, with time constant ``window_s``."""

    __slots__ = ("window_s", "value", "at", "start")

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s!r}")
        self.window_s = window_s
        self.value = 0.0
        self.at: float | None = None  # when value was last brought up to date
        self.start: float | None = None  # the first add: how much of the window has been seen

    def __call__(self, now: float) -> float:
        """The rate at ``now`` (0 before the first add)."""
        if self.at is None:
            return 0.0
        return self.value * math.exp(-max(now - self.at, 0.0) / self.window_s)

    def add(self, now: float, amount: float = 1.0) -> None:
        self.value = self(now) + amount / self.window_s
        self.at = now
        if self.start is None:
            self.start = now

    def warmed(self, now: float, max_scale: float = 10.0) -> float:
        """The rate over the time seen so far while that is shorter than the window (a fresh accumulator otherwise
        reads near 0 for its first ``window_s``), scaled up at most ``max_scale`` times."""
        if self.start is None:
            return 0.0
        seen = now - self.start
        scale = 1.0 / (1.0 - math.exp(-seen / self.window_s)) if seen > 0 else 1.0
        return self(now) * min(scale, max_scale)
