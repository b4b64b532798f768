"""A route's shadow traffic (``routes[].mirror``): a copy of its upstream calls sent to
another backend, whose answers are read to the end and dropped.  The way to try a new model
version or server on real traffic before any client depends on it (nginx's ``mirror``,
Envoy's ``request_mirror_policies``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.policy.backend import Backend
from gateway.policy.metadata import doc

DEFAULT_MIRROR_FRACTION = 1.0
DEFAULT_MIRROR_MAX_IN_FLIGHT = 16
MAX_MIRROR_IN_FLIGHT = 10_000

Found = list[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class Mirror:
    """Shadow traffic: a copy of the route's upstream calls, sent to another backend."""

    backend: str = field(
        metadata=doc(
            "The backend the copies go to (a new model version, another server). Its answers "
            "are read to the end and dropped: the client never waits for one or sees it."
        )
    )
    fraction: float = field(
        default=DEFAULT_MIRROR_FRACTION,
        metadata=doc("Share of the route's upstream calls copied, 0 to 1, drawn per call."),
    )
    max_in_flight: int = field(
        default=DEFAULT_MIRROR_MAX_IN_FLIGHT,
        metadata=doc(
            "Copies in flight at most, in each gateway process: a call past it is not copied "
            "(counted as `shed`), so a slow shadow holds no more than this. 1 to 10000."
        ),
    )
    model: str | None = field(
        default=None,
        metadata=doc(
            "The model the shadow is asked for (a JSON body's `model`: OpenAI's and "
            "Anthropic's APIs); none: the model the route's backend was asked for."
        ),
    )


def check_mirror(mirror: Mirror, route_backend: str, backends: dict[str, Backend]) -> Found:
    """A route's ``mirror``: a known backend other than the route's, and bounds that hold."""
    found: Found = []
    if mirror.backend not in backends:
        found.append(("mirror.backend", f"unknown backend {mirror.backend!r}"))
    elif mirror.backend == route_backend:
        found.append(("mirror.backend", "the route's own backend cannot be its mirror"))
    if not 0 <= mirror.fraction <= 1:
        found.append(("mirror.fraction", "must be between 0 and 1"))
    if not 1 <= mirror.max_in_flight <= MAX_MIRROR_IN_FLIGHT:
        found.append(("mirror.max_in_flight", f"must be between 1 and {MAX_MIRROR_IN_FLIGHT}"))
    if mirror.model is not None and not mirror.model.strip():
        found.append(("mirror.model", "must name a model, or be left out"))
    return found
