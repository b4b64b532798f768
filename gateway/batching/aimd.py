"""How many items a batch may hold: a fixed size, or one that AIMD moves against a latency target.

Clipper (NSDI'17) adapts the batch size by additive increase while the recent p90 batch
latency is under the target and a 10% multiplicative decrease when over.  Both limits also
take an out-of-memory ceiling (``backoff_to``): after the backend ran out of memory at some
size the limit never goes above half of it again, or AIMD would walk straight back into it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Protocol

from gateway.clock import SYSTEM_CLOCK, Clock

DEFAULT_STEP = 1.0
DEFAULT_BACKOFF = 0.9
DEFAULT_QUANTILE = 0.9
DEFAULT_WINDOW = 20
DEFAULT_WINDOW_S = 10.0
DEFAULT_MIN_SAMPLES = 3


class BatchLimit(Protocol):
    """The number of items the next batch may hold, fed with how the last ones went."""

    @property
    def limit(self) -> int: ...

    @property
    def max_size(self) -> int: ...

    def observe(self, latency_s: float, items: int) -> None:
        """One upstream batch of ``items`` items took ``latency_s``."""

    def backoff_to(self, size: int) -> None:
        """Never exceed ``size`` again (the backend ran out of memory above it)."""


class FixedLimit:
    """``max_size``, lowered only by out-of-memory back-offs."""

    def __init__(self, max_size: int) -> None:
        if max_size < 1:
            raise ValueError("max_size must be at least 1")
        self._max = max_size
        self._ceiling = max_size

    @property
    def limit(self) -> int:
        return self._ceiling

    @property
    def max_size(self) -> int:
        return self._max

    def observe(self, latency_s: float, items: int) -> None:
        pass

    def backoff_to(self, size: int) -> None:
        self._ceiling = max(1, min(self._ceiling, size))

    def __repr__(self) -> str:
        return f"<FixedLimit limit={self.limit}/{self._max}>"


class AimdLimit:
    """Additive increase / multiplicative decrease of the batch size against a p90 target.

    The size grows by ``step`` after each full batch (one of ``limit`` items) while the p90
    of the recent batch latencies is at or under the target: a batch smaller than the limit
    says nothing about whether the limit is affordable.  It shrinks by ``backoff`` when the
    p90 is over the target, once at least ``min_samples`` latencies were seen at the current
    size; the window is then cleared, since latencies of the larger size no longer apply.
    Recent means the last ``window`` batches within ``window_s`` seconds of ``clock``.
    """

    def __init__(
        self,
        max_size: int,
        target_latency_ms: float,
        *,
        clock: Clock = SYSTEM_CLOCK,
        initial: int = 1,
        step: float = DEFAULT_STEP,
        backoff: float = DEFAULT_BACKOFF,
        quantile: float = DEFAULT_QUANTILE,
        window: int = DEFAULT_WINDOW,
        window_s: float = DEFAULT_WINDOW_S,
        min_samples: int = DEFAULT_MIN_SAMPLES,
    ) -> None:
        if max_size < 1:
            raise ValueError("max_size must be at least 1")
        if target_latency_ms <= 0 or not 0 < backoff < 1 or step <= 0:
            raise ValueError("target_latency_ms and step must be > 0, backoff in (0, 1)")
        self._max = max_size
        self._ceiling = max_size
        self._size = float(min(max(1, initial), max_size))
        self._target_s = target_latency_ms / 1000.0
        self._clock = clock
        self._step = step
        self._backoff = backoff
        self._quantile = quantile
        self._window_s = window_s
        self._min_samples = min_samples
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)

    @property
    def limit(self) -> int:
        return max(1, min(self._ceiling, int(self._size)))

    @property
    def max_size(self) -> int:
        return self._max

    @property
    def target_latency_ms(self) -> float:
        return self._target_s * 1000.0

    def recent_p(self) -> float | None:
        """The ``quantile`` of the recent batch latencies in seconds, None with no samples."""
        if not self._samples:
            return None
        ordered = sorted(latency for _, latency in self._samples)
        rank = max(1, math.ceil(self._quantile * len(ordered)))
        return ordered[rank - 1]

    def observe(self, latency_s: float, items: int) -> None:
        now = self._clock.now()
        while self._samples and now - self._samples[0][0] > self._window_s:
            self._samples.popleft()
        self._samples.append((now, latency_s))
        p = self.recent_p()
        if p is not None and p > self._target_s:
            if len(self._samples) >= self._min_samples:
                self._size = max(1.0, self._size * self._backoff)
                self._samples.clear()
        elif items >= self.limit:
            self._size = min(float(self._ceiling), self._size + self._step)

    def backoff_to(self, size: int) -> None:
        self._ceiling = max(1, min(self._ceiling, size))
        self._size = min(self._size, float(self._ceiling))
        self._samples.clear()

    def __repr__(self) -> str:
        p = self.recent_p()
        p_text = "-" if p is None else f"{p * 1000:.0f}ms"
        return (
            f"<AimdLimit limit={self.limit}/{self._max} target={self.target_latency_ms:.0f}ms "
            f"p{self._quantile * 100:.0f}={p_text} samples={len(self._samples)}>"
        )


class CappedLimit:
    """Another limit, held at or below a cap read per batch (a GPU throttle rule's
    ``limit: {batch_max_size}`` while it holds); the inner limit keeps learning."""

    def __init__(self, inner: BatchLimit, cap: Callable[[], int | None]) -> None:
        self._inner = inner
        self._cap = cap

    @property
    def limit(self) -> int:
        cap = self._cap()
        inner = self._inner.limit
        return inner if cap is None else max(1, min(inner, cap))

    @property
    def max_size(self) -> int:
        return self._inner.max_size

    def observe(self, latency_s: float, items: int) -> None:
        self._inner.observe(latency_s, items)

    def backoff_to(self, size: int) -> None:
        self._inner.backoff_to(size)

    def __repr__(self) -> str:
        return f"<CappedLimit limit={self.limit} cap={self._cap()} inner={self._inner!r}>"
