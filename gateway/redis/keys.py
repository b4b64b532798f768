"""Hash tags: the part of a key Redis Cluster hashes to pick its slot.

Keys that one command or one round trip uses together carry the same tag, ``{...}``, so
they live in one slot, on one master: the rate limits' buckets of a route and tenant
(``{<route>:<tenant>}``, one script call), the cache's band buckets of a context
(``{<context>}``, one pipeline per lookup).  Cluster hashes only what lies between the first
``{`` and the next ``}``, so a tag's text has its braces (and ``%``) escaped; standalone Redis
ignores tags, so the layout is the same in every mode.
"""

from __future__ import annotations


def escape(text: str, also: str = "") -> str:
    """``text`` with ``%``, braces and the characters of ``also`` written ``%XX``: it cannot
    end a tag early, and distinct texts stay distinct."""
    for char in "%{}" + also:
        text = text.replace(char, f"%{ord(char):02X}")
    return text


def tag(*parts: str) -> str:
    """``{part1:part2...}``, each part escaped, and every part's colons but the last's, so
    the first colons left split the parts and no two lists of parts share a tag."""
    *head, last = parts
    return "{" + ":".join([*(escape(part, ":") for part in head), escape(last)]) + "}"
