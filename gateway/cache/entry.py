"""``CachedResponse``: one stored answer, and its compact serialised form.

An answer is kept either as a JSON ``body`` or as the ``events`` of a completed SSE stream
(each event block as sent, ``[DONE]`` included: ``openai.sse``); ``replies`` converts
between the two.  Entries written before events were kept as sent hold the ``data:``
payloads only, without ``[DONE]``; they are read as the blocks those payloads make.  The
serialised form (``dumps``/``loads``) is what Redis holds and what the memory store counts
as an entry's bytes: a magic tag, a JSON header, then the payload, zlib-compressed when that
pays.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.openai.sse import stored_blocks

STORED_HEADERS = ("content-type", "openai-model", "openai-processing-ms")
COMPRESS_FROM_BYTES = 1024
_MAGIC = b"GWC1"
_HEAD = struct.Struct(">4sBI")
_ZLIB = 1


@dataclass(frozen=True, slots=True)
class CachedResponse:
    """A successful answer as stored: exactly one of ``body`` and ``events`` is set.

    ``scope`` is the tenant scope hash, ``prompt`` the final user message the answer was
    for (the guard re-checks it on near-duplicate hits), ``fingerprint`` its SimHash and
    ``context`` its context key (both None when the near tier does not apply),
    ``prompt_form`` the prompt's ``normalize.comparable_form`` (None in entries stored before
    it existed: the guard then normalises ``prompt`` again), and ``created_at`` the wall time
    it was stored, for the ``Age`` header.
    """

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes | None
    events: tuple[str, ...] | None
    created_at: float
    backend: str
    model_version: str
    route: str
    scope: str
    prompt: str | None = None
    context: str | None = None
    fingerprint: int | None = None
    prompt_form: str | None = None

    def __post_init__(self) -> None:
        if (self.body is None) == (self.events is None):
            raise ValueError("a CachedResponse holds exactly one of body and events")

    @property
    def streamed(self) -> bool:
        return self.events is not None


def select_headers(
    headers: Iterable[tuple[str, str]], names: Iterable[str] = STORED_HEADERS
) -> tuple[tuple[str, str], ...]:
    """The response headers worth storing (never hop-by-hop or per-request ones)."""
    wanted = {n.lower() for n in names}
    return tuple((k, v) for k, v in headers if k.lower() in wanted)


def dumps(entry: CachedResponse) -> bytes:
    """The compact serialised form of ``entry``."""
    head = {
        "s": entry.status,
        "h": entry.headers,
        "t": entry.created_at,
        "b": entry.backend,
        "m": entry.model_version,
        "r": entry.route,
        "c": entry.scope,
        "p": entry.prompt,
        "x": entry.context,
        "f": entry.fingerprint,
        "n": entry.prompt_form,
        "e": entry.events is not None,
        "v": 1,  # events as sent (``openai.sse``), not data payloads
    }
    header = json.dumps(head, separators=(",", ":")).encode()
    if entry.events is not None:
        payload = json.dumps(entry.events, separators=(",", ":")).encode()
    else:
        payload = entry.body or b""
    flags = 0
    if len(payload) >= COMPRESS_FROM_BYTES:
        packed = zlib.compress(payload, 1)
        if len(packed) < len(payload):
            payload, flags = packed, _ZLIB
    return _HEAD.pack(_MAGIC, flags, len(header)) + header + payload


def loads(data: bytes) -> CachedResponse:
    """Parse what ``dumps`` wrote; ``ValueError`` for anything else."""
    try:
        magic, flags, size = _HEAD.unpack_from(data)
        if magic != _MAGIC:
            raise ValueError("not a cache entry")
        start = _HEAD.size
        # ``dumps`` writes the header as ASCII: decoding it here skips ``json.loads``'s
        # detection of a byte string's encoding, which is Python code.
        head = json.loads(data[start : start + size].decode())
        payload = data[start + size :]
        if flags & _ZLIB:
            payload = zlib.decompress(payload)
        events = tuple(json.loads(payload)) if head["e"] else None
        if events is not None and not head.get("v"):
            events = stored_blocks(events)
        return CachedResponse(
            status=head["s"],
            headers=tuple((str(k), str(v)) for k, v in head["h"]),
            body=None if events is not None else bytes(payload),
            events=events,
            created_at=head["t"],
            backend=head["b"],
            model_version=head["m"],
            route=head["r"],
            scope=head["c"],
            prompt=head["p"],
            context=head["x"],
            fingerprint=head["f"],
            prompt_form=head.get("n"),
        )
    except (struct.error, KeyError, TypeError, zlib.error, json.JSONDecodeError) as exc:
        raise ValueError(f"corrupt cache entry: {exc}") from exc
