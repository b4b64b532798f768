"""One request body as it arrives: its pace, its chunk framing and its trailers.

- **Pace.**  A body must keep to ``min_body_rate_bytes_s`` (Kestrel's minimum data rate):
  it starts with ``body_timeout_s`` of slack, spends the slack as time passes and earns it
  back (up to ``body_timeout_s``) with every byte, one second per ``min_body_rate_bytes_s``
  bytes.  A body out of slack is a 408.  So a body may be silent for ``body_timeout_s`` at
  most, as before, but one that trickles a byte every few seconds after sending most of
  itself fast is cut too; and whatever its pace, it must be whole within
  ``body_deadline_s``.  How far a body is behind its pace (``stall_s``) is what the server
  cuts first when request bodies crowd its buffer.
- **Framing.**  llhttp bounds no chunk extension: a body whose chunk framing (size lines,
  extensions, trailers) takes far more bytes than its chunks need is a 400.
- **Trailers** are never headers: dropped, bounded like a head (431), and a field that may
  not be a trailer (RFC 9110 6.5.1: framing, routing, credentials, request modifiers, the
  content's own fields) is a 400.
"""

from __future__ import annotations

from gateway.errors import MalformedRequest
from gateway.policy.model import Server as Limits

CHUNK_OVERHEAD_BYTES = 256
"""Framing bytes a body piece may take (a chunk's size line, extensions and line ends); a
chunk's own framing is a few bytes.  Pieces are llhttp's: a chunk split between two reads
is two, which only allows a little more."""
FORBIDDEN_TRAILERS = frozenset(
    {
        "transfer-encoding",
        "content-length",
        "host",
        "authorization",
        "proxy-authorization",
        "api-key",
        "x-api-key",
        "cookie",
        "cache-control",
        "expect",
        "max-forwards",
        "pragma",
        "range",
        "te",
        "trailer",
        "content-encoding",
        "content-type",
        "content-range",
        "if-match",
        "if-none-match",
        "if-modified-since",
        "if-unmodified-since",
        "if-range",
    }
)
"""Fields a trailer may not carry: a request that sends one is a 400."""


class BodyReading:
    """A body being read: when it began, its slack, its framing's size."""

    __slots__ = ("chunked", "credit_at", "credit_s", "pieces", "started", "trailer_bytes", "wire")

    def __init__(self, now: float, limits: Limits, *, chunked: bool) -> None:
        self.started = now
        self.credit_s = limits.body_timeout_s
        self.credit_at = now
        self.chunked = chunked
        self.wire = 0  # bytes fed while it is read (chunked only)
        self.pieces = 0
        self.trailer_bytes = 0

    def arrived(self, size: int, now: float, limits: Limits) -> None:
        """``size`` payload bytes arrived at ``now``: slack earned back."""
        rate = limits.min_body_rate_bytes_s
        if rate > 0:
            credit = self.credit_s - (now - self.credit_at) + size / rate
            self.credit_s = min(limits.body_timeout_s, credit)
            self.credit_at = now

    def deadline(self, last_read: float, limits: Limits) -> tuple[float, str]:
        """When the body runs out of slack (``body``), or of time (``body_whole``)."""
        whole = self.started + limits.body_deadline_s
        if limits.min_body_rate_bytes_s > 0:
            paced = self.credit_at + self.credit_s
        else:
            paced = last_read + limits.body_timeout_s
        return (paced, "body") if paced <= whole else (whole, "body_whole")

    def stall_s(self, now: float, last_read: float, limits: Limits) -> float:
        """How far the body has fallen behind its pace (0: on pace)."""
        if limits.min_body_rate_bytes_s > 0:
            return max(0.0, limits.body_timeout_s - (self.credit_s - (now - self.credit_at)))
        return now - last_read

    def framing_overflows(self, fed: int, payload: int, limits: Limits) -> bool:
        """Whether, ``fed`` more bytes in, the chunk framing takes far more than its chunks
        need (the head's and the trailers' bytes are allowed for)."""
        self.wire += fed
        allowed = 2 * limits.max_header_bytes + (self.pieces + 1) * CHUNK_OVERHEAD_BYTES
        return self.wire - payload > allowed

    def trailer(self, name: bytes, value: bytes, limits: Limits) -> None:
        """A field of the trailer section: bounded, checked (raised), then dropped."""
        self.trailer_bytes += len(name) + len(value) + 4
        if self.trailer_bytes > limits.max_header_bytes:
            raise MalformedRequest(
                f"the request's trailers are larger than {limits.max_header_bytes} bytes", 431
            )
        field = name.decode("latin-1").lower()
        if field in FORBIDDEN_TRAILERS:
            raise MalformedRequest(f"{field} may not be sent in a trailer")

    def __repr__(self) -> str:
        return f"<BodyReading slack={self.credit_s:.1f}s pieces={self.pieces}>"
