"""Per training step, one rank's share of the global gradient norm: the sum of its layers' squared gradients."""

from __future__ import annotations

import threading


class GradSquares:
    """Sums of squared gradient entries per step, added by the optimizer thread as each layer steps, handed
    over (`take`) once all `layers` of this rank have stepped for that step (backends/rank/metrics.py)."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self._sums: dict[int, tuple[int, float]] = {}  # step -> (layers stepped, their sum of squares)
        self._lock = threading.Lock()

    def add(self, step: int, squares: float) -> None:
        with self._lock:
            n, total = self._sums.get(step, (0, 0.0))
            self._sums[step] = (n + 1, total + squares)

    def take(self) -> dict[int, float]:
        """The steps all layers have stepped since the last call, with their sums."""
        with self._lock:
            done = {k: t for k, (n, t) in self._sums.items() if n == self.layers}
            for k in done:
                del self._sums[k]
        return done
