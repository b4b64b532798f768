"""What a backend's answer says about being stored and reused: its ``Cache-Control`` and
``Vary`` (RFC 9111), which win over the route's ``cache:`` unless the route sets
``ignore_backend_cache_control``.

- ``no-store`` and ``private`` (this gateway is a shared cache) are not stored, nor is
  ``no-cache`` on a whole answer (the gateway cannot revalidate).  On an event stream
  ``no-cache`` is what SSE servers send so that no intermediary buffers the live stream
  (TGI's axum, sse-starlette, this project's simulator): the cache stores the stream only
  once it has completed, so it does not apply there.  ``s-maxage``, else ``max-age``, caps
  the entry's lifetime (0: not stored).
- ``Vary: *`` is not stored.  Any other ``Vary`` names request headers whose values the
  answer depends on: the cache learns them per route, and from then on their values, as the
  client sent them, join the scope every key of that route is made under (``vary_scope``),
  so a request is answered only from an entry made for the same values.  A process that has
  not learned them yet keys without them and so cannot find entries made with them: a miss,
  never a wrong answer.  ``Accept-Encoding`` is left out (stored answers are replayed
  uncompressed, which every client accepts), and so are the scope's own headers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gateway.tenant import scope_hash
from gateway.transport.headers import SSE_TYPE

MAX_VARY_NAMES = 8
"""Request headers a route's answers may vary on; an answer naming more is not stored."""
IGNORED_VARY = frozenset({"accept-encoding"})
_NOT_STORED = ("no-store", "private", "no-cache")


@dataclass(frozen=True, slots=True)
class Storable:
    """Whether an answer may be stored, why not, for how long at most, and the request
    headers it varies on (lower case, sorted)."""

    ok: bool
    reason: str = ""
    max_age_s: float | None = None
    vary: tuple[str, ...] = ()


STORE_ANY = Storable(True)


def storable(headers: Iterable[tuple[str, str]]) -> Storable:
    """What an answer's ``Cache-Control`` and ``Vary`` allow."""
    directives: dict[str, str] = {}
    vary: set[str] = set()
    stream = False
    for name, value in headers:
        lower = name.lower()
        if lower == "content-type":
            stream = value.split(";", 1)[0].strip().lower() == SSE_TYPE
        elif lower == "cache-control":
            for part in value.split(","):
                key, _, arg = part.partition("=")
                directives.setdefault(key.strip().lower(), arg.strip().strip('"'))
        elif lower == "vary":
            vary.update(v.strip().lower() for v in value.split(",") if v.strip())
    for directive in _NOT_STORED:
        if directive in directives and not (stream and directive == "no-cache"):
            return Storable(False, directive)
    max_age = _seconds(directives.get("s-maxage", directives.get("max-age")))
    if max_age is not None and max_age <= 0:
        return Storable(False, "max-age=0")
    if "*" in vary:
        return Storable(False, "vary_all")
    names = tuple(sorted(vary - IGNORED_VARY))
    if len(names) > MAX_VARY_NAMES:
        return Storable(False, "vary_too_wide")
    return Storable(True, "", max_age, names)


def asked_not_to(value: str | None) -> tuple[bool, bool]:
    """(no-cache, no-store) from a request's ``Cache-Control``: the client asks not to be
    answered from the cache, or not to have its answer stored."""
    if not value:
        return False, False
    directives = {part.split("=", 1)[0].strip().lower() for part in value.split(",")}
    return "no-cache" in directives, "no-store" in directives


def vary_key(headers: Iterable[tuple[str, str]], names: Iterable[str]) -> str:
    """What joins a key for the request's values of the headers ``names`` ("" for none)."""
    wanted = sorted(names)
    if not wanted:
        return ""
    return ",".join(wanted) + ":" + scope_hash(headers, wanted)


def _seconds(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return float(int(value))
    except ValueError:
        return None


class LearnedVary:
    """The request headers a route's answers have been seen to vary on (``ignored``: the
    scope's own headers, already in every key)."""

    def __init__(self, ignored: Iterable[str] = ()) -> None:
        self.names: frozenset[str] = frozenset()
        self._ignored = frozenset(n.lower() for n in ignored) | IGNORED_VARY

    def key(self, headers: Iterable[tuple[str, str]]) -> str:
        """What joins the keys of a request with ``headers`` (``vary_key``)."""
        return vary_key(headers, self.names) if self.names else ""

    def learn(self, names: Iterable[str]) -> bool:
        """Add the headers an answer varies on; False when that would pass
        ``MAX_VARY_NAMES`` (then the answer is not stored)."""
        new = frozenset(names) - self._ignored
        if new <= self.names:
            return True
        merged = self.names | new
        if len(merged) > MAX_VARY_NAMES:
            return False
        self.names = merged
        return True

    def __repr__(self) -> str:
        return f"<LearnedVary {sorted(self.names)}>"
