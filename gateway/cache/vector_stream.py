"""The record format of the embedding index streams, ``<prefix>v:<route>`` in Redis.

Shared by the tier that appends and reads them (``embedding/shared.py``) and by the Redis
store, which files every stream's name in a set and deletes a purged entry's records on a
filtered purge (``stores/redis.py``, ``stores/redis_purge.py``).

A record has one field, ``i``: its origin (random per tier instance, so a tier skips what
it published itself), the embedder's identity, the context key and the entry key, joined by
0x1F bytes, then a 0x00 byte and the unit vector as little-endian float16.  One field, not
one per part: parsing is most of a catch-up's time, and it is paid per field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

STREAM = "v:"
"""The stream of route R is ``<store prefix>v:R``."""
STREAMS = "vs"
"""``<store prefix>vs`` is the set of the streams' names, filed by every append, so that a
filtered purge finds them without scanning the keyspace."""
FIELD = b"i"
SEP = b"\x1f"
_END = b"\x00"


class Record(NamedTuple):
    """One record's parts; ``vector`` is the raw little-endian float16 bytes."""

    origin: bytes
    embedder: bytes
    context: bytes
    entry_key: bytes
    vector: bytes


def clean(part: bytes) -> bytes:
    """``part`` with the format's separators blanked out (for a free-form embedder name)."""
    return part.replace(SEP, b" ").replace(_END, b" ")


def packable(part: bytes) -> bool:
    """Whether ``part`` holds neither separator (always so for the cache's hex keys)."""
    return SEP not in part and _END not in part


def pack(origin: bytes, embedder: bytes, context: bytes, entry_key: bytes, vector: bytes) -> bytes:
    """The field value of a record; every part but ``vector`` must be ``packable``."""
    return SEP.join((origin, embedder, context, entry_key)) + _END + vector


def unpack(fields: Mapping[bytes, bytes]) -> Record | None:
    """A record's parts from its stream fields; None if it is not one."""
    head, _, vector = fields.get(FIELD, b"").partition(_END)
    parts = head.split(SEP)
    if len(parts) != 4:
        return None
    origin, embedder, context, key = parts
    return Record(origin, embedder, context, key, vector)


def entry_key(fields: Mapping[bytes, bytes]) -> bytes | None:
    """The entry key a record indexes; None if it is not a record."""
    record = unpack(fields)
    return record.entry_key if record is not None else None
