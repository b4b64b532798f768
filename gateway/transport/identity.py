"""Which weights a backend serves, asked of its model servers (``model_version: auto``).

A cached answer is keyed by its backend's ``model_version``, so new weights never meet the
old weights' answers.  Set by hand, the version is only as good as the deploy that bumps
it: ``ollama pull`` replaces a tag's weights in place, a TGI pod restarted on a new
revision keeps its model name.  With ``model_version: auto`` each endpoint is asked what it
serves every ``model_version_interval_s``, over its own pool, by the first of these it
answers:

* ``GET /info`` (TGI, TEI): ``model_id``, ``model_sha`` (the Hub revision), ``model_dtype``;
* ``GET /api/tags`` (Ollama): each model's name and ``digest`` (its weights' sha256);
* ``GET /v1/models`` (vLLM, llama.cpp, any OpenAI-compatible server): each model's ``id``,
  ``root`` and ``parent`` (vLLM's weights path and a LoRA adapter's base) and of ``meta``
  what is the weights' (llama.cpp's parameter count, vocabulary, file size and type, never
  its ``n_ctx``, the server's setting); never ``created`` and the like, which change on
  every call.

What an endpoint answered is its identity; the backend's version is a digest of the
distinct identities of its endpoints (``auto:`` and 12 hex digits), the same in every
gateway replica that sees the same servers, so replicas sharing a Redis cache share its
entries.  Mid-rollout, replicas old and new give a version of their own, which the end of
the rollout leaves behind.  A probe that fails keeps the endpoint's last identity (a
hiccup must not change every key); an endpoint never identified is left out; while no
endpoint of the backend is identified the version is unknown, and the cache neither
answers nor stores that backend's calls.  A request is keyed by the version of the model it
names (``Identities.version_for``): that model's own part of each statement, so an adapter
loaded or a model pulled beside it leaves its keys as they were; a model no endpoint lists
takes the whole version.  New weights are seen within one interval: until
then answers are filed under the old version.  An endpoint new to the set (discovery, a
reload) is asked within ``NEW_ENDPOINT_S``, not at the next round.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.errors import UpstreamError
from gateway.metrics import Metrics
from gateway.policy.model import Backend
from gateway.transport.endpoint import Endpoint

log = logging.getLogger("gateway.transport")

AUTO = "auto"
"""The ``model_version`` that asks the servers."""
UNKNOWN = "auto:unknown"
"""The version of a backend none of whose endpoints said what it serves (never stored)."""
NEW_ENDPOINT_S = 1.0
"""How soon an endpoint new to the backend's set is asked, between rounds."""
PROBE_TIMEOUT_S = 5.0
"""The longest one probe may take (less when the interval is shorter)."""
MAX_MODELS = 256
"""Models of one answer read; more are ignored (a list that long is no one's weights)."""
_OPENAI_FIELDS = ("id", "root", "parent")
_META_FIELDS = ("vocab_type", "n_vocab", "n_ctx_train", "n_embd", "n_params", "size", "ftype")
"""What of llama.cpp's ``meta`` is its weights' (never ``n_ctx``, the server's setting)."""
_INFO_FIELDS = ("model_id", "model_sha", "model_dtype", "model_type")


Found = tuple[Any, dict[str, Any]]
"""What a server said, whole, and each model's own part of it by the name a request gives
it (``"*"``: whatever a request names)."""


def _info(doc: Any) -> Found | None:
    if not isinstance(doc, dict) or not isinstance(doc.get("model_id"), str):
        return None
    found = {k: doc[k] for k in _INFO_FIELDS if doc.get(k) is not None}
    return found, {"*": found}  # one model, whatever a request calls it (TGI, TEI)


def _entries(doc: Any, key: str) -> list[dict[str, Any]]:
    """The objects of the list ``doc[key]``, the first ``MAX_MODELS`` (none: no such list)."""
    listed = doc.get(key) if isinstance(doc, dict) else None
    if not isinstance(listed, list):
        return []
    return [m for m in listed[:MAX_MODELS] if isinstance(m, dict)]


def _tags(doc: Any) -> Found | None:
    parts: dict[str, Any] = {}
    for m in _entries(doc, "models"):
        if isinstance(m.get("name"), str) and m.get("digest"):
            name = m["name"]
            parts[name] = f"{name}@{m['digest']}"
            if name.endswith(":latest"):  # a request may name `llama3` for `llama3:latest`
                parts[name.removesuffix(":latest")] = parts[name]
    return (sorted(set(parts.values())), parts) if parts else None


def _models(doc: Any) -> Found | None:
    parts: dict[str, Any] = {}
    for m in _entries(doc, "data"):
        if isinstance(m.get("id"), str):
            found = {k: m[k] for k in _OPENAI_FIELDS if m.get(k) is not None}
            meta = m.get("meta")
            if isinstance(meta, dict):
                found["meta"] = {k: meta[k] for k in _META_FIELDS if meta.get(k) is not None}
            parts[m["id"]] = found
    for name, found in list(parts.items()):  # an adapter answers by its base's weights too
        parent = found.get("parent")
        if isinstance(parent, str) and parent in parts and parent != name:
            parts[name] = {**found, "base": parts[parent]}
    whole = sorted(parts.values(), key=lambda m: json.dumps(m, sort_keys=True))
    return (whole, parts) if parts else None


PROBES: tuple[tuple[str, Callable[[Any], Found | None]], ...] = (
    ("/info", _info),
    ("/api/tags", _tags),
    ("/v1/models", _models),
)
"""Where a model server says what it serves, the most precise first, and what of it counts."""


@dataclass(frozen=True, slots=True)
class Statement:
    """What one endpoint said it serves: ``whole``, and ``models``, each model's own part
    by the name a request gives it (``"*"``: any name), each prefixed by the path asked."""

    whole: str
    models: Mapping[str, str]

    def of(self, model: str | None) -> str:
        """What counts for a request naming ``model``: that model's part, or the whole
        statement for a model the server does not list (or a request naming none)."""
        if model is None:
            return self.whole
        return self.models.get(model) or self.models.get("*") or self.whole


def statement_of(path: str, body: bytes) -> Statement | None:
    """What ``body``, a server's answer at ``path``, states (None: nothing)."""
    read = dict(PROBES)[path]
    try:
        found = read(json.loads(body))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if found is None:
        return None
    whole, parts = found
    return Statement(_said(path, whole), {name: _said(path, p) for name, p in parts.items()})


def identity_of(path: str, body: bytes) -> str | None:
    """The whole identity ``body``, a server's answer at ``path``, states (None: none)."""
    found = statement_of(path, body)
    return found.whole if found is not None else None


def _said(path: str, found: Any) -> str:
    return f"{path} {json.dumps(found, sort_keys=True, separators=(',', ':'))}"


_GONE = Statement("", {})
"""No statement at that path (the server has no such path, or says nothing there)."""
MAX_MODEL_VERSIONS = 1024
"""Versions of listed models remembered per backend between two changes of statement."""


def version_of(identities: Sequence[str]) -> str:
    """The backend's version for its endpoints' ``identities`` (``UNKNOWN`` with none)."""
    distinct = sorted(set(identities))
    if not distinct:
        return UNKNOWN
    digest = hashlib.sha256("\n".join(distinct).encode()).hexdigest()
    return f"{AUTO}:{digest[:12]}"


class Identities:
    """Keeps one ``model_version: auto`` backend's version: its endpoints probed every
    interval, each one's identity by URL (so a set replaced by a reload keeps what is
    known of the endpoints it keeps)."""

    def __init__(self, backend: Backend, metrics: Metrics) -> None:
        self.backend = backend
        self._shown = metrics.backend_model_identity
        self._by_url: dict[str, Statement] = {}
        self._of_model: dict[str, str] = {}  # versions of listed models, while nothing changes
        self._path: dict[str, str] = {}  # the probe each endpoint answered
        self._tried: set[str] = set()  # the endpoints asked at least once
        self._shown_version: str | None = None
        self.version = UNKNOWN
        self._task: asyncio.Task[None] | None = None
        self._warned = False

    def start(
        self,
        endpoints: Callable[[], Sequence[Endpoint]],
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        """Probe ``endpoints`` (the backend's set as it is now) until ``stop``."""
        self.stop()
        self._task = asyncio.get_running_loop().create_task(self._watch(endpoints, sleep))

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def forget(self) -> None:
        """The backend is gone or no longer ``auto``: stop, and drop its series."""
        self.stop()
        self._show(None)

    def _show(self, version: str | None) -> None:
        """``gateway_backend_model_identity``: 1 for ``version`` (``UNKNOWN`` too: what the
        alert on a backend left uncached reads), none once the backend is gone."""
        if version == self._shown_version:
            return
        if self._shown_version is not None:
            self._shown.remove(self.backend.name, self._shown_version)
        if version is not None:
            self._shown.labels(self.backend.name, version).set(1)
        self._shown_version = version

    async def _watch(
        self, endpoints: Callable[[], Sequence[Endpoint]], sleep: Callable[[float], Awaitable[Any]]
    ) -> None:
        since = math.inf  # seconds since the last round over every endpoint
        while True:
            interval = self.backend.model_version_interval_s
            current = list(endpoints())
            if since >= interval:
                asked, since = current, 0.0
            else:  # between rounds, an endpoint new to the set (discovery, a reload) at once
                asked = [e for e in current if e.url not in self._tried]
            if asked:
                self._tried.update(e.url for e in asked)
                probed = await asyncio.gather(
                    *(self.probe(e) for e in asked), return_exceptions=True
                )
                for failed in {type(p): p for p in probed if isinstance(p, Exception)}.values():
                    log.error(
                        "backend %s: model identity probe failed",
                        self.backend.name,
                        exc_info=failed,
                    )
            if asked or {e.url for e in current} != self._tried:  # one came or went
                self.settle([e.url for e in current])
            tick = min(interval, NEW_ENDPOINT_S)
            await sleep(tick)
            since += tick

    async def probe(self, endpoint: Endpoint) -> None:
        """Ask ``endpoint`` what it serves: at the probe it answered last, else at each in
        turn while it has no such path.  One it cannot be asked now keeps what it said."""
        known = self._path.get(endpoint.url)
        for path in [known] if known is not None else [p for p, _ in PROBES]:
            answer = await self._ask(endpoint, path)
            if answer is None:
                return
            if answer is not _GONE:
                if self._by_url.get(endpoint.url) != answer:
                    self._of_model.clear()
                self._by_url[endpoint.url] = answer
                self._path[endpoint.url] = path
                return
        if known is not None:  # the server says it there no more: each probe next round
            del self._path[endpoint.url]

    async def _ask(self, endpoint: Endpoint, path: str) -> Statement | None:
        """The statement at ``path``; ``_GONE`` when the server has no such path (404, 405)
        or an answer there that states none; None when it could not be asked."""
        timeout_s = min(PROBE_TIMEOUT_S, self.backend.model_version_interval_s)
        try:
            async with asyncio.timeout(timeout_s):
                reply = await endpoint.pool.send(
                    self.backend, "GET", path, [], b"", streaming=False
                )
                if reply.close is not None:
                    await reply.close()
        except (UpstreamError, TimeoutError) as exc:
            log.debug("model identity of %s at %s: %r", endpoint.url, path, exc)
            return None
        if reply.status in (404, 405):
            return _GONE
        if reply.status != 200:
            return None
        return statement_of(path, reply.body or b"") or _GONE

    def version_for(self, model: str | None) -> str:
        """The version a request naming ``model`` is keyed by: of that model's own part of
        what each endpoint said, so one model's new weights, or an adapter loaded or a model
        pulled beside it, leave the other models' keys as they were.  A model no endpoint
        lists by name (or a server of one model, TGI's) takes ``version``, of everything
        they said; only listed names are remembered (a client may name any string)."""
        if model is None:
            return self.version
        found = self._of_model.get(model)
        if found is not None:
            return found
        if not any(model in s.models for s in self._by_url.values()):
            return self.version
        found = version_of([s.of(model) for s in self._by_url.values()])
        if len(self._of_model) >= MAX_MODEL_VERSIONS:
            self._of_model.clear()
        self._of_model[model] = found
        return found

    def settle(self, urls: Sequence[str]) -> None:
        """Make the version that of the endpoints ``urls`` as last probed."""
        if set(self._by_url) - set(urls):
            self._of_model.clear()
        self._by_url = {u: i for u, i in self._by_url.items() if u in urls}
        self._path = {u: p for u, p in self._path.items() if u in urls}
        self._tried = set(urls)
        version = version_of([s.whole for s in self._by_url.values()])
        self._show(version)
        if version == self.version:
            if version == UNKNOWN and not self._warned and urls:
                self._warned = True
                log.warning(
                    "backend %s: model_version auto, but no endpoint says what it serves "
                    "(GET /info, /api/tags, /v1/models); its calls are not cached",
                    self.backend.name,
                )
            return
        log.info(
            "backend %s: model version %s (was %s): %s",
            self.backend.name,
            version,
            self.version,
            "; ".join(sorted({s.whole for s in self._by_url.values()}))[:500]
            or "no endpoint identified",
        )
        self.version = version
