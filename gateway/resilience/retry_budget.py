"""A retry budget: retries may add at most ``ratio`` extra upstream calls over a window.

Fallback after a failure is a retry, and retries of every request in an outage would double
the load on whatever is still standing.  As in Finagle and Envoy, retries are allowed up to
``ratio`` of the requests seen in the last ``window_s``, plus a floor of ``min_retries_per_s``
so that a quiet service can still fail over.  Calls sent elsewhere on purpose (an open
breaker, a throttle reroute) are not retries and do not spend it.
"""

from __future__ import annotations

from gateway.clock import SYSTEM_CLOCK, Clock
from gateway.policy.model import RetryBudget
from gateway.resilience.rolling import RollingCounts


class RetryAllowance:
    """Counts requests and retries; ``try_spend`` says whether one more retry fits."""

    def __init__(self, config: RetryBudget | None = None, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = config = config or RetryBudget()
        self.denied = 0
        self._counts = RollingCounts(("requests", "retries"), config.window_s, clock)

    def record_request(self) -> None:
        """Count a first attempt (every request, retried or not)."""
        self._counts.add("requests")

    @property
    def available(self) -> float:
        """Retries the budget allows now."""
        c = self.config
        allowed = c.ratio * self._counts.total("requests") + c.min_retries_per_s * c.window_s
        return max(0.0, allowed - self._counts.total("retries"))

    def try_spend(self) -> bool:
        """Take one retry from the budget; False (and counted in ``denied``) when it is spent."""
        if self.available >= 1:
            self._counts.add("retries")
            return True
        self.denied += 1
        return False

    def __repr__(self) -> str:
        requests = self._counts.total("requests")
        retries = self._counts.total("retries")
        return (
            f"<RetryAllowance requests={requests} retries={retries} "
            f"available={self.available:.0f} denied={self.denied}>"
        )
