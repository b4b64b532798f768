"""Where a batcher reports what the metrics show: the observer protocol, and an observer
that reports nowhere."""

from __future__ import annotations

from typing import Protocol


class BatchObserver(Protocol):
    """Where the batcher reports what the metrics show; bind the route's labels in it."""

    def batch_sent(self, items: int) -> None:
        """An upstream call with ``items`` items went out (``gateway_batch_size``)."""

    def waited(self, seconds: float) -> None:
        """A caller waited ``seconds`` before its batch went (``gateway_batch_wait_seconds``)."""

    def limit_changed(self, limit: int) -> None:
        """The batch size limit is now ``limit`` (``gateway_batch_limit``)."""

    def split(self, reason: str) -> None:
        """A merged call failed as if for a bad input (``reason``: 4xx, 5xx, unsplittable)
        and was split in halves (``gateway_batch_splits_total``)."""

    def oom_backoff(self) -> None:
        """The backend ran out of memory and the limit was halved (``..._oom_backoffs_total``)."""


class NullObserver:
    """Reports nowhere."""

    def batch_sent(self, items: int) -> None:
        pass

    def waited(self, seconds: float) -> None:
        pass

    def limit_changed(self, limit: int) -> None:
        pass

    def split(self, reason: str) -> None:
        pass

    def oom_backoff(self) -> None:
        pass
