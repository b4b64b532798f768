"""One model list over several backends (a route's ``merge_models``).

With routes split by model (``llama*`` to one server, ``bge*`` to another), a client's
``GET /v1/models`` reaches one backend and lists only its models, and ``GET
/v1/models/<id>`` of another's model is a 404.  A route that names ``merge_models``
answers both for all its backends:

- ``GET /v1/models`` asks the route's backend and every one it names at once, each
  uncompressed, and lists each model once, the first backend (in the route's order) to
  list an id giving its entry.  A backend that fails (refused, timed out, an error status,
  a list that is not OpenAI's shape) is left out and named in ``X-Gateway-Models-Missing``
  and in ``gateway_model_list_missing_total{route,backend}``; a client is never told a
  partial list is whole.  When every one fails, the route's own backend's failure is the
  answer.
- ``GET /v1/models/<id>`` asks them in order; the first 200 answers.  When none knows the
  model, the first failure that is not a 404 is the answer (an outage is not "no such
  model"), else the last 404.

Each backend is asked through the rest of the pipeline (breakers, admission, throttling),
the named ones without the route's fallback, whose list is not theirs.  A named tenant's
cut (``allowed_models``) applies to the merged list at the edge, as to any other.

The names clients may use that no backend serves are listed too: a route whose
``match.model`` is one name (no glob) and whose backend is asked for ``target_models``
makes that name an alias, added to every ``GET /v1/models`` list (after the backends'
models, unless one of them lists the name itself) and answered at
``GET /v1/models/<alias>`` by the gateway, ``owned_by: sidecar-gateway``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

from gateway.errors import GatewayError
from gateway.metrics import Metrics
from gateway.openai.allowed_models import UnreadableListing, read_listing, uncompressed
from gateway.pipeline import Call, Handler, Reply, Stage
from gateway.policy.match import Match, takes
from gateway.policy.model import Policy
from gateway.policy.route import MODEL_LIST_PATH

MISSING_HEADER = "X-Gateway-Models-Missing"
OWNER = "sidecar-gateway"
_ONE_MODEL = MODEL_LIST_PATH + "/"
_GLOB = frozenset("*?[")
Alias = tuple[dict[str, Any], Match]
"""A model name a route answers for: its entry in the list, and the route's match."""


class ModelLists:
    """The stage; see the module docstring."""

    def __init__(self, missing: Callable[[str, str], None], aliases: dict[str, Alias]) -> None:
        self._missing = missing
        self._aliases = aliases

    async def __call__(self, call: Call, call_next: Handler) -> Reply:
        names = call.route.merge_models
        if call.method != "GET" or not (names or self._aliases):
            return await call_next(call)
        if call.path == MODEL_LIST_PATH:
            return await self._merged(call, call_next, names, self._told(call))
        if call.path.startswith(_ONE_MODEL):
            alias = self._told(call).get(unquote(call.path[len(_ONE_MODEL) :]))
            if alias is not None:
                return _json(alias, "")
            if names:
                return await self._first_known(call, call_next, names)
        return await call_next(call)

    def _told(self, call: Call) -> dict[str, dict[str, Any]]:
        """The aliases whose routes would take ``call``'s caller."""
        return {
            name: entry
            for name, (entry, match) in self._aliases.items()
            if takes(match, call.tenant, call.received)
        }

    async def _merged(
        self,
        call: Call,
        call_next: Handler,
        names: tuple[str, ...],
        aliases: dict[str, dict[str, Any]],
    ) -> Reply:
        asked = (call.backend, *names)
        answers = await asyncio.gather(
            *(
                _listing(call_next, _asking(call, backend, uncompressed(call.headers)))
                for backend in asked
            )
        )
        entries: dict[str, Any] = {}
        answered: list[str] = []
        missing: list[str] = []
        for backend, answer in zip(asked, answers, strict=True):
            if isinstance(answer, list):
                answered.append(backend)
                for entry in answer:
                    entries.setdefault(entry["id"], entry)
            else:
                missing.append(backend)
                self._missing(call.route.name, backend)
        if not answered:
            failure = answers[0]
            if isinstance(failure, GatewayError):
                raise failure
            assert isinstance(failure, Reply)
            return failure
        for alias, entry in aliases.items():
            entries.setdefault(alias, entry)
        reply = _json({"object": "list", "data": list(entries.values())}, ",".join(answered))
        return reply.with_headers(((MISSING_HEADER, ", ".join(missing)),)) if missing else reply

    async def _first_known(self, call: Call, call_next: Handler, names: tuple[str, ...]) -> Reply:
        chosen: Reply | GatewayError | None = None  # the answer if no backend knows the model
        try:
            for backend in (call.backend, *names):
                outcome: Reply | GatewayError
                try:
                    outcome = await call_next(_asking(call, backend, call.headers))
                except GatewayError as exc:
                    outcome = exc
                if isinstance(outcome, Reply) and outcome.status == 200:
                    return outcome
                if chosen is None or _not_found(chosen):  # an outage outranks a 404
                    await _close(chosen)
                    chosen = outcome
                else:
                    await _close(outcome)
            if isinstance(chosen, GatewayError):
                raise chosen
            assert chosen is not None
            reply, chosen = chosen, None
            return reply
        finally:
            await _close(chosen)

    def __repr__(self) -> str:
        return "<ModelLists>"


def _asking(call: Call, backend: str, headers: tuple[tuple[str, str], ...]) -> Call:
    if backend == call.backend:
        return dataclasses.replace(call, headers=headers)
    return dataclasses.replace(
        call,
        backend=backend,
        headers=headers,
        route=dataclasses.replace(call.route, fallback=()),
        record=None,  # the route's own backend tells the access log
    )


async def _listing(call_next: Handler, call: Call) -> list[Any] | Reply | GatewayError:
    """The entries of one backend's list, or its failure (a whole reply, nothing held open)."""
    try:
        reply = await call_next(call)
    except GatewayError as exc:
        return exc
    try:
        if reply.status == 200:
            listing = read_listing(reply)
            if listing is not None:
                entries: list[Any] = listing["data"]
                return entries
            return UnreadableListing(
                f"the model list of backend {call.backend!r} could not be read", call.backend
            )
        if reply.body is None:  # an error streamed: its status is the news
            return reply.replace(stream=None, body=b"", close=None, content_length=None)
        return reply.replace(close=None)  # closed below
    finally:
        await _close(reply)


def _json(data: dict[str, Any], backend: str) -> Reply:
    body = json.dumps(data).encode()
    return Reply(200, (("Content-Type", "application/json"),), body=body, backend=backend)


def aliases_of(policy: Policy) -> dict[str, Alias]:
    """The model names routes answer for with ``target_models`` (one name, no glob), each
    as an entry of OpenAI's model list, with the match of its route (whose tenants and
    headers say who is told of it)."""
    return {
        route.match.model: (
            {"id": route.match.model, "object": "model", "created": 0, "owned_by": OWNER},
            route.match,
        )
        for route in policy.routes
        if route.target_models
        and route.match.model is not None
        and not _GLOB.intersection(route.match.model)
    }


def _not_found(outcome: Reply | GatewayError) -> bool:
    return isinstance(outcome, Reply) and outcome.status == 404


async def _close(reply: Reply | GatewayError | None) -> None:
    if isinstance(reply, Reply) and reply.close is not None:
        await reply.close()


def build(policy: Policy, metrics: Metrics) -> list[Stage]:
    """The stage, when a route merges model lists or a model name is an alias."""
    aliases = aliases_of(policy)
    if not aliases and not any(route.merge_models for route in policy.routes):
        return []
    missing = metrics.model_list_missing
    return [ModelLists(lambda route, name: missing.labels(route, name).inc(), aliases)]
