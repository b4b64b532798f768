"""How much one call may ask a model to generate (a route's ``generation``).

A call asking for more output tokens than the route's ``max_tokens`` is sent with
``max_tokens`` instead (or refused, ``over: refuse``); a call naming no bound, or ``null``, is
given ``default_max_tokens`` (else ``max_tokens``), so that it cannot hold a slot for the
model's whole context; a call asking for more choices than ``max_choices`` (``n``, a
completion's ``best_of``) is refused: clamping those would change the answer's shape.
``X-Gateway-Max-Tokens`` tells the client the bound its call was sent with whenever the
gateway set it.

Under a bound, a value the gateway cannot read as the positive integer it must be is a 400
naming the field, never passed on: model servers read loosely (pydantic turns
``"100000"`` and ``100000.0`` into an integer; llama.cpp reads ``-1`` as no bound at all),
so a bound a client could write around would bound nothing.

The servers' own APIs are bounded alike (``NATIVE_PATHS``): llama.cpp's ``/completion``
(``n_predict``), Ollama's ``/api/generate`` and ``/api/chat`` (``options.num_predict``),
TGI's ``/generate``, ``/generate_stream`` and ``/`` (``parameters.max_new_tokens``; at ``/``,
only a body naming ``inputs``, TGI's: ``PROMPT_NEEDED``), SGLang's
``/generate`` (``sampling_params.max_new_tokens``), vLLM's demonstration server's
``/generate`` (``max_tokens``), llama.cpp's ``/infill``, and Triton's generate extension,
``/v2/models/<m>/generate`` (TensorRT-LLM's ``max_tokens``, vLLM's backend's
``parameters.max_tokens``, or its ``sampling_parameters``: a JSON text, read and written back
as one).  The gateway
reads their bodies only on a route with bounds (strict JSON, as for OpenAI's; a body it
cannot read is a 400, a compressed one a 415), and there a bound below 1, which those
servers take for none (``-1``: until the end; ``-2``: until the context is full), asks for
more than ``max_tokens``.

The stage stands before the cache, single flight and the limits: they see the call as it
goes upstream, so a clamped call shares the cache and a flight with one that asked for the
bound, and a token limit's estimate is the bound it was sent with.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from gateway.errors import FieldRefused, RequestError, integer_field
from gateway.metrics import Metrics
from gateway.openai.body import dumps_yielding, native_object, texts_read, texts_written
from gateway.openai.triton_bounds import bounded_infer, single_members
from gateway.pipeline import Call, Handler, Reply, Stage
from gateway.policy.generation import (
    BY_PROMPT,
    CHOICE_FIELDS,
    LISTED_CALLS,
    PARAMETER_LISTS,
    TEXT_MEMBERS,
    TRITON_INFER,
    Generation,
    generates,
    is_native,
    output_fields,
    prompt_list,
    tensor_value,
    tighter,
)
from gateway.policy.model import Policy

BOUND_HEADER = "X-Gateway-Max-Tokens"
UNBOUNDED = 1 << 62
"""What a server's own API asks for with a bound below 1 (none: until the end)."""
ACTIONS = ("clamped", "defaulted", "refused")
TURN_ITEMS = 1024
"""Calls or prompts of one body bounded between the event loop's turns (a batch of 50,000
prompts takes about 150 ms)."""


class GenerationBounds:
    """The stage; see the module docstring.  ``counted(route, action)`` counts each change
    or refusal."""

    def __init__(
        self,
        routes: dict[str, Generation],
        counted: Callable[[str, str], None],
        tenants: dict[str, Generation] | None = None,
    ) -> None:
        self._routes = routes
        self._counted = counted
        self._tenants = tenants or {}
        self._both = {  # a route's bounds tightened by each named tenant's
            (name, tenant): tighter(bounds, own)
            for name, bounds in routes.items()
            for tenant, own in self._tenants.items()
        }

    def _bounds(self, call: Call) -> Generation | None:
        """The route's bounds, tightened by the named tenant's."""
        if call.tenant and call.tenant in self._tenants:
            both = self._both.get((call.route.name, call.tenant))
            return both if both is not None else self._tenants[call.tenant]
        return self._routes.get(call.route.name)

    async def __call__(self, call: Call, call_next: Handler) -> Reply:
        bounds = self._bounds(call)
        if bounds is None or call.method != "POST":
            return await call_next(call)
        if call.path.startswith("/v2/") and TRITON_INFER.fullmatch(call.path):
            return await self._infer(call, bounds, call_next)
        if not bounded_path(call.path):
            return await call_next(call)
        native = is_native(call.path)
        texts: tuple[str, ...] = ()  # the members read from JSON text, written back as text
        try:
            data = await _native_body(call) if native else call.json
            if data is None:
                return await call_next(call)
            if call.path.startswith("/v2/"):  # Triton's generate: RapidJSON reads the first
                single_members(call.body)
            if native:
                data, texts = texts_read(data, TEXT_MEMBERS, call.policy.server.max_json_values)
            sent_data = await bounded_data(data, call.path, bounds)
        except RequestError:
            self._done(call, "refused", 0)
            raise
        if sent_data is None:
            return await call_next(call)
        data, action, bound = sent_data
        self._done(call, action, bound)
        data = texts_written(data, texts)
        body = await dumps_yielding(data, len(call.body))
        if native:  # its body read here only: the call goes on as a server's own API's
            sent = dataclasses.replace(call, body=body)
        else:
            sent = dataclasses.replace(call, json=data, body=body)
        reply = await call_next(sent)
        return reply.with_headers(((BOUND_HEADER, str(bound)),))

    async def _infer(self, call: Call, bounds: Generation, call_next: Handler) -> Reply:
        """Triton's ``infer``, bounded in its tensors (``triton_bounds``)."""
        try:
            sent = await bounded_infer(call, bounds)
        except RequestError:
            self._done(call, "refused", 0)
            raise
        if sent is None:
            return await call_next(call)
        body, headers, bound = sent
        self._done(call, "clamped", bound)
        reply = await call_next(dataclasses.replace(call, body=body, headers=headers))
        return reply.with_headers(((BOUND_HEADER, str(bound)),))

    def _done(self, call: Call, action: str, bound: int) -> None:
        """Count what was done to ``call`` (``action``), and record it for its log line."""
        self._counted(call.route.name, action)
        if call.record is not None:
            call.record.generation = (action, bound)

    def __repr__(self) -> str:
        return f"<GenerationBounds routes={sorted(self._routes)}>"


def bounded_path(path: str) -> bool:
    """Whether calls to ``path`` generate, and so are bounded."""
    return output_fields(path) is not None or path in LISTED_CALLS


async def bounded_data(
    data: dict[str, Any], path: str, bounds: Generation
) -> tuple[dict[str, Any], str, int] | None:
    """``data`` as it is sent under ``bounds``, with the action and the bound written (None
    when it is sent as it came); ``FieldRefused`` for a call it refuses.  A body that lists
    calls (``LISTED_CALLS``) has each bounded, and at most ``max_choices`` of them."""
    listed = LISTED_CALLS.get(path)
    each_prompts = PARAMETER_LISTS.get(path)
    if listed is None and each_prompts is not None and isinstance(data.get(each_prompts), list):
        return await _bounded_each(data, path, bounds, each_prompts)
    if listed is None:
        changes, action = bounded(data, path, bounds)
        if not changes:
            return None
        return with_bounds(data, changes), action, next(iter(changes.values()))
    member, each = listed
    calls = data.get(member)
    if not isinstance(calls, list):
        return None  # the server's to refuse
    if bounds.max_choices is not None and len(calls) > bounds.max_choices:
        raise FieldRefused(
            f"'{member}' holds {len(calls)} calls; this route allows at most {bounds.max_choices}",
            member,
            "array_above_max_length",
        )
    sent: list[Any] = []
    written: tuple[str, int] | None = None
    for n, one in enumerate(calls, 1):
        if n % TURN_ITEMS == 0:
            await asyncio.sleep(0)
        changes, action = bounded(one, each, bounds) if isinstance(one, dict) else ({}, "")
        if changes:
            one = with_bounds(one, changes)
            written = written or (action, next(iter(changes.values())))
        sent.append(one)
    if written is None:
        return None
    return {**data, member: sent}, *written


async def _bounded_each(
    data: dict[str, Any], path: str, bounds: Generation, member: str
) -> tuple[dict[str, Any], str, int] | None:
    """``bounded_data`` of a call whose ``member`` lists one parameters object for each
    prompt (``PARAMETER_LISTS``): each bounded as the call's own, given the default where
    it names none, so no prompt of the batch goes unbounded; a list that is not one object
    for each prompt is refused (the server's reading of it is not the gateway's to guess)."""
    listed, (field, prompts) = data[member], prompt_list(path, data)
    if len(listed) != prompts:
        raise FieldRefused(
            f"'{member}' lists {len(listed)} objects for the {prompts} prompts of '{field}': "
            "give one for each prompt, or one object for all",
            member,
            "invalid_value",
        )
    if not all(isinstance(one, dict) for one in listed):
        raise FieldRefused(
            f"Invalid type for '{member}': expected objects, one for each prompt",
            member,
            "invalid_type",
        )
    if bounds.max_choices is not None:  # each prompt's samples (``n``), added up
        answers = sum(_integer(one, "n") or 1 for one in listed)
        if answers > bounds.max_choices:
            raise FieldRefused(
                f"'{field}' holds {prompts} prompts, {answers} answers in all; this route "
                f"allows at most {bounds.max_choices}",
                field,
                "array_above_max_length",
            )
    # each bounded as one prompt's call: the batch's prompts read once, not once a prompt
    one_prompt = {name: value for name, value in data.items() if name != field}
    sent: list[Any] = []
    written: tuple[str, int] | None = None
    call = one_prompt
    for n, one in enumerate(listed, 1):
        if n % TURN_ITEMS == 0:
            await asyncio.sleep(0)
        changes, action = bounded({**one_prompt, member: one}, path, bounds)
        if changes:
            call = with_bounds({**one_prompt, member: one}, changes)
            one = call[member]
            written = written or (action, next(iter(changes.values())))
        sent.append(one)
    if written is None:
        return None
    return {**data, **call, member: sent}, *written


def bounded(data: dict[str, Any], path: str, bounds: Generation) -> tuple[dict[str, int], str]:
    """The fields of ``data`` (a call to ``path``) that ``bounds`` changes, with the action
    (``clamped``, ``defaulted``; none: ``{}``); ``FieldRefused`` for a call it refuses."""
    if bounds.max_choices is not None:
        each = 1  # the answers asked for each prompt
        for name in CHOICE_FIELDS.get(path, ()):
            asked = _integer(data, name)
            if asked is not None and asked > bounds.max_choices:
                raise FieldRefused(
                    f"'{name}' is {asked}; this route allows at most {bounds.max_choices}",
                    name,
                    "integer_above_max_value",
                )
            each = max(each, asked or 1)
        field, prompts = prompt_list(path, data)
        if prompts * each > bounds.max_choices:
            raise FieldRefused(
                f"'{field}' holds {prompts} prompts, {prompts * each} answers in all; this "
                f"route allows at most {bounds.max_choices}",
                field,
                "array_above_max_length",
            )
    if not bounds.bounds_tokens or not generates(path, data):
        return {}, ""
    most = bounds.max_tokens
    fields = output_fields(path) or ()
    changes: dict[str, int] = {}
    named = False
    native = is_native(path)
    for name in fields:
        asked = _integer(data, name, native, path)
        if asked is None:
            continue
        named = True
        if most is not None and asked > most:
            if bounds.over == "refuse":
                told = "no bound" if asked == UNBOUNDED else str(asked)
                raise FieldRefused(
                    f"'{name}' is {told}; this route allows at most {most} output tokens",
                    name,
                    "integer_above_max_value",
                )
            changes[name] = most
    if named:
        return changes, "clamped"
    default = bounds.default_max_tokens or most
    assert default is not None  # bounds_tokens
    sent = (f for f in fields if isinstance(data.get(f.rpartition(".")[0]), dict))
    by_prompt = (f for prompt, f in BY_PROMPT.get(path, {}).items() if prompt in data)
    return {next(sent, next(by_prompt, fields[0])): default}, "defaulted"


async def _native_body(call: Call) -> dict[str, Any]:
    """The JSON object a server's own API was sent (read for its bounds only)."""
    return await native_object(
        call.body,
        call.header("Content-Encoding"),
        call.policy.server.max_json_values,
        "this route bounds what a call may generate",
    )


def with_bounds(data: dict[str, Any], changes: dict[str, int]) -> dict[str, Any]:
    """``data`` with each dotted field of ``changes`` set (its object made where absent)."""
    data = dict(data)
    for name, value in changes.items():
        outer, _, inner = name.rpartition(".")
        if outer:
            data[outer] = {**(data.get(outer) or {}), inner: value}
        else:
            data[name] = value
    return data


def _integer(data: dict[str, Any], name: str, native: bool = False, path: str = "") -> int | None:
    """``data``'s dotted field ``name`` as the positive integer a bound must be (absent or
    null: None; on a server's own API, below 1 is no bound: ``UNBOUNDED``; on Triton's
    generate, a tensor's list of one is its value: ``tensor_value``)."""
    outer, _, inner = name.rpartition(".")
    if outer:
        holder = data.get(outer)
        if holder is None:
            return None
        if not isinstance(holder, dict):
            raise FieldRefused(
                f"Invalid type for '{outer}': expected an object", outer, "invalid_type"
            )
        value = holder.get(inner)
    else:
        value = tensor_value(path, name, data.get(name))
    if value is None:
        return None
    value = integer_field(value, name)
    if value < 1 and native:
        return UNBOUNDED
    if value < 1:
        raise FieldRefused(
            f"Invalid '{name}': {value}; it must be at least 1", name, "integer_below_min_value"
        )
    return value


def build(policy: Policy, metrics: Metrics) -> list[Stage]:
    """The stage, when a route or a named tenant bounds its generations."""
    routes = {r.name: r.generation for r in policy.routes if r.generation is not None}
    tenants = policy.tenants.generations()
    if not routes and not tenants:
        return []
    counters = {  # labels() costs microseconds a call: each child is made once
        (route.name, action): metrics.generation_bounds.labels(route.name, action).inc
        for route in policy.routes
        for action in ACTIONS
    }
    return [GenerationBounds(routes, lambda route, action: counters[(route, action)](), tenants)]
