"""``POST /cache/feedback``: a client says whether a cached answer it got was right.

Every whole cached answer names its entry in ``X-Gateway-Cache-Key`` (the exact, SimHash,
embedding and judged tiers alike).  A client that finds the answer wrong for its question
(a paraphrase matched to a question that was not the same, a stale fact) posts
``{"key": <that header>, "verdict": "wrong"}`` to the gateway's own port: the entry is
dropped from the store and from its route's embedding index and judged aliases, so the
next request for it, or for any paraphrase of it, goes to the backend.  ``"right"`` drops
nothing.  Both are counted (``gateway_cache_feedback_total{route, verdict}``): the share of
``wrong`` among them is the false-hit rate the route's users report, beside the one its
budget was calibrated for (``semantic.max_false_hit_rate``).  Each entry counts once: a
``right`` given again for an entry already judged right (by this process, among its last
``MAX_JUDGED``) is answered but not counted (``"counted": false``), so a client repeating
it cannot tilt the share; a ``wrong`` always counts, and drops the entry, so it comes once
per entry stored.

Only the entry's own tenant may judge it: the caller's scope (the hash of its credential
headers, ``cache.scope_headers``, as every lookup computes it) must be the entry's, else
the answer is the 404 of a key that does not exist, so a key learned elsewhere tells
nothing and drops nothing.  The body is at most ``MAX_BODY_BYTES``.  Each caller scope gives
at most ``cache.feedback_per_min`` verdicts a minute, a minute's worth at once (429 past
it, with ``Retry-After``), so no client turns the endpoint into a free stream of store
reads.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

from gateway.cache.replies import KEY_HEADER
from gateway.cache.stage import EMBEDDING_TIERS
from gateway.cache.state import CACHE_STATE, FEEDBACK_LIMITS
from gateway.errors import GatewayError, RateLimited, RequestError, StoreError, shown
from gateway.state import Registry

FEEDBACK_PATH = "/cache/feedback"
VERDICTS = ("right", "wrong")
MAX_BODY_BYTES = 4096
MAX_KEY_CHARS = 512
MAX_JUDGED = 16_384
"""Entries judged right that a process remembers (16 bytes of each key's hash), the
oldest forgotten first."""


class EntryNotFound(RequestError):
    """No entry of the caller's under that key (none at all, expired, or another tenant's)."""

    status = 404
    code = "cache_entry_not_found"


class NoCache(RequestError):
    """No route of the policy caches."""

    status = 404
    code = "not_found"


class StoreUnavailable(GatewayError):
    """The store failed while the feedback was applied: the client may send it again."""

    status = 503
    code = "cache_store_unavailable"


def parse(body: bytes) -> tuple[str, str]:
    """``(key, verdict)`` of a feedback body; ``RequestError`` (400) for any other body."""
    if len(body) > MAX_BODY_BYTES:
        raise RequestError(f"a feedback body is at most {MAX_BODY_BYTES} bytes")
    try:
        data: Any = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):  # nested past what json reads
        raise RequestError('the body must be JSON: {"key": ..., "verdict": ...}') from None
    if not isinstance(data, dict):
        raise RequestError('the body must be a JSON object: {"key": ..., "verdict": ...}')
    unknown = sorted(set(data) - {"key", "verdict"})
    if unknown:
        raise RequestError(f"unknown fields {shown(', '.join(map(str, unknown)))}")
    key, verdict = data.get("key"), data.get("verdict")
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS:
        raise RequestError(f"`key` must be the {KEY_HEADER} of a cached answer")
    if verdict not in VERDICTS:
        raise RequestError("`verdict` must be `right` or `wrong`")
    return key, verdict


async def give(
    registry: Registry,
    scope: str,
    body: bytes,
    count: Callable[[str, str], None],
    limited: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Apply one feedback of the caller of ``scope``; what the answer's JSON says.
    ``count(route, verdict)`` counts it; ``limited()`` counts one refused past the
    caller's rate (``cache.feedback_per_min``: 429)."""
    state = registry.peek(CACHE_STATE)
    if state is None:
        raise NoCache("no route of the policy caches, so there is no cached answer to judge")
    limits = registry.peek(FEEDBACK_LIMITS)
    if limits is not None:
        try:
            limits.check(scope)
        except RateLimited as exc:
            limited()
            per_min = (limits.limit.requests_per_s or 0) * 60
            wait_s = exc.retry_after_s or 1
            raise RateLimited(
                f"at most {per_min:g} verdicts a minute per caller: wait {wait_s:g} s", wait_s
            ) from None
    key, verdict = parse(body)
    try:
        entry = await state.store.get(key)
    except StoreError as exc:
        raise StoreUnavailable(f"the cache store failed: {exc}") from exc
    if entry is None or entry.scope != scope:
        raise EntryNotFound(f"no cached answer of yours under {shown(key)}")
    dropped, counted = False, True
    judged, digest = state.judged_right, hashlib.sha256(key.encode()).digest()[:16]
    if verdict == "right":
        counted = digest not in judged
        judged[digest] = None
        judged.move_to_end(digest)
        if len(judged) > MAX_JUDGED:
            judged.popitem(last=False)
    else:
        judged.pop(digest, None)
    if verdict == "wrong":
        try:
            await state.store.delete(key)
        except StoreError as exc:
            raise StoreUnavailable(f"the cache store failed: {exc}") from exc
        tier = registry.peek(EMBEDDING_TIERS, entry.route)
        forget = getattr(tier, "forget", None)
        if forget is not None:
            forget(key)
        dropped = True
    if counted:
        count(entry.route, verdict)
    return {
        "key": key,
        "verdict": verdict,
        "route": entry.route,
        "dropped": dropped,
        "counted": counted,
    }
