"""Which outermost forwards are traced: every Nth, and/or a ratio; the caller's unsampled span wins."""

from __future__ import annotations

import itertools
import random


class ForwardSampler:
    """Decides once per outermost forward; the inner calls of an unsampled forward only count their depth."""

    __slots__ = ("every", "ratio", "_counter")

    def __init__(self, every: int = 1, ratio: float = 1.0) -> None:
        self.every = every
        self.ratio = ratio
        self._counter = itertools.count()  # next() is atomic under the GIL: safe across threads

    def should_trace(self) -> bool:
        if next(self._counter) % self.every:
            return False
        return self.ratio >= 1.0 or random.random() < self.ratio
