"""The model servers' own deterministic calls (``OWN_API_PATH``: KServe V2 / Triton
``infer``, TF Serving ``:predict``, TEI's, llama.cpp's, Ollama's and vLLM's embeddings,
reranking and classification; ``OWN_GREEDY``: llama.cpp's, Ollama's, TGI's and SGLang's
generations asked greedy, whole or streamed), keyed for the cache and single flight.

Such a call is keyed by its body's bytes, not by its parsed JSON: a tensor of 400,000
numbers (8 MB of JSON) takes a second of the event loop to parse and write canonically,
and 7 ms to hash, and a client sends the same inputs as the same bytes.  The headers that
say how to read the bytes are keyed with them (``FRAMING_HEADERS``: KServe's binary tensor
extension, a compressed body).  The stage sees the call with ``json`` holding only that
digest (``keyed``), never the next stages: the call goes on as it came (``sending``).
A generation's body is read (strict JSON, bounded as every body the gateway reads) only to
tell whether it asks a greedy answer; one the gateway cannot read is not cached.  Ollama's
``/api/chat`` is keyed by that JSON instead of its bytes (``OLLAMA_CHAT``), so that a route's
near-duplicate tiers serve its paraphrases as they serve chat's.  A greedy stream
(llama.cpp's SSE, Ollama's NDJSON, Ollama's default) is keyed as its body is, with
``stream`` in ``json`` so the stages hand it on as a stream; it is stored as it came, and
only once it has ended as the server ends one well (``ended``: llama.cpp's last event
``"stop": true``, Ollama's last line ``"done": true``, TGI's last event its whole
``"generated_text"``, SGLang's last event a ``"finish_reason"`` object, none after an
error), and a hit replays its bytes.

A KServe V2 request's ``id`` is echoed in its answer, and KServe's own Python client sends a
fresh one with every call (``uuid4``): keyed with it, no call would ever hit.  So an ``id``
that opens the body (``{"id": "...", ...}``, as those clients write it; a plain string) is
left out of the key and kept beside it (``REQUEST_ID``); the answer is stored with a
placeholder where it echoed that id (``stored``), and a hit answers with the caller's own
(``answered``).  A call without one is keyed apart from calls with one; an answer that
frames its JSON by length (the binary tensor extension's ``Inference-Header-Content-Length``)
is not stored for a call whose id was left out, as its id could not be rewritten.  Calls
in flight that differ only by such an id share one call by single flight the same way
(``placeheld``, then ``answered``), unless they ask for binary tensors (``shares_answers``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import RequestError
from gateway.openai.body import native_object
from gateway.pipeline import Call, Handler, Headers, Reply
from gateway.policy.generation import dotted
from gateway.policy.model import Route
from gateway.transport.headers import content_encoded, is_streamed

OWN_API_PATH = re.compile(
    r"/v2/models/[^/]+(?:/versions/[^/]+)?/infer"  # KServe V2, Triton
    r"|/v1/models/[^/]+(?:/versions/[^/]+)?:(?:predict|classify|regress)"  # TF Serving
    r"|/(?:embed|embed_all|embed_sparse|predict|similarity)"  # TEI
    r"|/(?:v1/|v2/)?(?:rerank|reranking|score)|/pooling|/classify"  # TEI, vLLM, llama.cpp
    r"|/embeddings?|/api/embed(?:dings)?"  # llama.cpp's, Ollama's (whole: not OpenAI's items)
)
"""The model servers' own calls whose answer their body alone decides (nothing sampled):
cached whole and shared by single flight where the route's ``cache.own_apis`` holds, keyed
by their body's bytes (``keyed``)."""
TGI_SAMPLING = ("temperature", "top_k", "top_p", "typical_p")
"""TGI's parameters any of which makes it sample (as its router reads them: set at all,
whatever the value, with ``do_sample``)."""


def _cold(field: str) -> Callable[[Mapping[str, Any]], bool]:
    """A server's greedy rule: its temperature ``field`` (dotted) a number at or below 0."""

    def greedy(body: Mapping[str, Any]) -> bool:
        temperature = dotted(body, field)
        if isinstance(temperature, bool) or not isinstance(temperature, int | float):
            return False
        return temperature <= 0

    return greedy


def tgi_greedy(body: Mapping[str, Any]) -> bool:
    """Whether a call to TGI's ``/generate``, ``/generate_stream`` or ``/`` asks a greedy
    answer: TGI's body (``inputs`` a string) with its ``parameters`` object, in it
    ``do_sample`` false or absent, none of ``TGI_SAMPLING`` set, ``best_of`` absent or 1.
    A body without ``parameters`` samples (TGI's router fills them in with ``do_sample:
    true``), and any other body (SGLang's and vLLM's ``/generate``) is not taken: its
    server's sampling rules are not read here."""
    parameters = body.get("parameters")
    if not isinstance(body.get("inputs"), str) or not isinstance(parameters, Mapping):
        return False
    if parameters.get("do_sample", False) is not False:
        return False
    best_of = parameters.get("best_of")
    if best_of is not None and (isinstance(best_of, bool) or best_of != 1):
        return False
    return all(parameters.get(name) is None for name in TGI_SAMPLING)


def sglang_greedy(body: Mapping[str, Any]) -> bool:
    """Whether a call to SGLang's ``/generate`` asks a greedy answer: its prompt in ``text``
    or ``input_ids`` (not TGI's ``inputs``), its ``sampling_params`` an object whose
    ``temperature`` is at or below 0 (SGLang then decodes greedily; its default is 1.0),
    and no ``session_params`` (a session's answer depends on its earlier turns)."""
    if "inputs" in body or ("text" not in body and "input_ids" not in body):
        return False
    return body.get("session_params") is None and _cold("sampling_params.temperature")(body)


def _asked(body: Mapping[str, Any]) -> bool:
    return body.get("stream") is True


@dataclass(frozen=True, slots=True)
class OwnGeneration:
    """How one server's own generation path reads: whether a call asks a greedy answer
    (``greedy``) and a stream (``streams``), and how such a stream ends well: its pieces
    parted by ``separator``, the last one matching ``last`` (after a ``trailer`` some
    servers add), no ``failed`` anywhere."""

    greedy: Callable[[Mapping[str, Any]], bool]
    streams: Callable[[Mapping[str, Any]], bool]
    last: re.Pattern[bytes]
    failed: re.Pattern[bytes]
    separator: bytes = b"\n\n"
    trailer: bytes = b""


_SSE_ERROR = re.compile(rb'^data: ?\{\s*"error"', re.MULTILINE)
LLAMA = OwnGeneration(  # its SSE: the last event says "stop" (older servers add a [DONE])
    _cold("temperature"),  # it samples at 0.8 unless told
    _asked,
    re.compile(rb'\A\s*data: ?\{.*(?<!\\)"stop"\s*:\s*true\s*[,}]', re.DOTALL),
    _SSE_ERROR,
    trailer=b"data: [DONE]",
)
OLLAMA = OwnGeneration(  # lines of JSON, the last one "done"; it streams unless told not to
    _cold("options.temperature"),
    lambda body: body.get("stream") is not False,
    re.compile(rb'\A\s*\{.*(?<!\\)"done"\s*:\s*true\s*[,}]', re.DOTALL),
    re.compile(rb'^\s*\{\s*"error"', re.MULTILINE),
    separator=b"\n",
)
TGI = OwnGeneration(  # its SSE: the last event carries the whole text, the others null
    tgi_greedy,
    _asked,
    re.compile(rb'\A\s*data: ?\{.*(?<!\\)"generated_text"\s*:\s*"', re.DOTALL),
    _SSE_ERROR,
)
SGLANG = OwnGeneration(  # its SSE: the last event's meta_info names why it finished
    sglang_greedy,
    lambda body: "inputs" not in body and body.get("stream") is True,
    re.compile(rb'\A\s*data: ?\{.*(?<!\\)"finish_reason"\s*:\s*\{', re.DOTALL),
    _SSE_ERROR,
    trailer=b"data: [DONE]",
)
OWN_GREEDY = {
    "/completion": LLAMA,
    "/completions": LLAMA,
    "/infill": LLAMA,
    "/api/generate": OLLAMA,
    "/api/chat": OLLAMA,
    # TGI's (whole, whatever it says) and SGLang's (streamed when asked), told apart by
    # their prompt's field: only SGLang's streams here
    "/generate": dataclasses.replace(
        SGLANG, greedy=lambda body: tgi_greedy(body) or sglang_greedy(body)
    ),
    "/generate_stream": dataclasses.replace(TGI, streams=lambda _: True),
    "/": TGI,  # TGI's compatibility route, where its Python clients post
}
"""The servers' own generation paths and how each reads (``OwnGeneration``): a call asking
a greedy answer (``greedy``) is cached as ``OWN_API_PATH``'s are."""


def greedy(body: Mapping[str, Any], path: str) -> bool:
    """Whether a call to ``path`` (``OWN_GREEDY``) asks a greedy answer: its temperature a
    number at or below 0 (llama.cpp's, Ollama's); TGI's, ``tgi_greedy``; SGLang's,
    ``sglang_greedy``."""
    return OWN_GREEDY[path].greedy(body)


def streams(body: Mapping[str, Any], path: str) -> bool:
    """Whether a call to ``path`` (``OWN_GREEDY``) asks for a stream: Ollama streams unless
    ``stream`` is false, llama.cpp, TGI's ``/`` and SGLang's ``/generate`` only when it is
    true, TGI's ``/generate_stream`` always and its ``/generate`` never."""
    return OWN_GREEDY[path].streams(body)


OLLAMA_CHAT = "/api/chat"
"""Ollama's chat: its ``messages`` are OpenAI's, so it is keyed by its parsed JSON (``stream``
as Ollama reads it), and the near-duplicate tiers read its last user message as chat's."""
BODY_DIGEST = "\x00body-sha256"
"""The member of a keyed call's ``json`` holding the digest: no server's JSON names one so."""
REQUEST_ID = "\x00request-id"
"""The member holding the ``id`` left out of the key (``keys`` leaves it out of the key)."""
_PLAIN = rb'"([\x20\x21\x23-\x5b\x5d-\x7e]{1,256})"'  # a JSON string without escapes
_LEADING_ID = re.compile(rb'\A\s*\{\s*"id"\s*:\s*' + _PLAIN + rb"\s*,")
"""An ``id`` opening the body, a plain ASCII string (no escape, no quote): what a KServe
client writes."""
_ECHO = re.compile(rb'"id"\s*:\s*' + _PLAIN)
"""An ``id`` echoed in an answer, a plain ASCII string as ``_LEADING_ID`` takes: one pattern
for every id (compiling one per id cost 53 us an answer and churned ``re``'s cache)."""
_PLACEHOLDER = b"\\u0000gateway-request-id"
"""Where a stored answer echoed its caller's id: a JSON string no server writes."""
_FRAMED = "inference-header-content-length"
_KSERVE_INFER = re.compile(r"/v2/models/[^/]+(?:/versions/[^/]+)?/infer")
FRAMING_HEADERS = ("content-type", "content-encoding", "inference-header-content-length")
"""Request headers that change what a body's bytes mean, keyed with them."""


def taken(route: Route) -> bool:
    """Whether ``route`` takes the servers' own calls as deterministic: its
    ``cache.own_apis``, or, on a route without a cache, always (single flight, a mirror's
    comparison)."""
    return route.cache is None or route.cache.own_apis


async def keyed(call: Call) -> Call | None:
    """``call`` with ``json`` holding its body's digest, when it is a server's own
    deterministic call; else None.  Computed once per call, its body and headers
    (``Call.own_key``): the cache and single flight both ask."""
    if call.json is not None or call.method != "POST":
        return None
    known = call.own_key
    if known is None or known[0] is not call.body or known[1] is not call.headers:
        known = call.own_key = (call.body, call.headers, await _key(call))
    return dataclasses.replace(call, json=known[2]) if known[2] is not None else None


async def _key(call: Call) -> dict[str, Any] | None:
    """What ``keyed`` puts in a call's ``json``; None for a call that is not keyed."""
    streamed = False
    if call.path in OWN_GREEDY:
        try:
            data = await native_object(
                call.body,
                call.header("Content-Encoding"),
                call.policy.server.max_json_values,
                "the cache",
            )
        except RequestError:  # the backend's to judge, uncached
            return None
        if not greedy(data, call.path):
            return None
        streamed = streams(data, call.path)
        if call.path == OLLAMA_CHAT:  # OpenAI's messages: keyed by its JSON, near tiers too
            return {**data, "stream": streamed, BODY_DIGEST: ""}
    elif not OWN_API_PATH.fullmatch(call.path):
        return None
    digest = hashlib.sha256()
    for name, value in call.headers:  # every value, in order: a server may read any
        if name.lower() in FRAMING_HEADERS:
            digest.update(f"{name.lower()}:{value}\n".encode(errors="surrogateescape"))
    found = _LEADING_ID.match(call.body) if _KSERVE_INFER.fullmatch(call.path) else None
    if found:  # the body without its leading id, uncopied
        digest.update(b"id\n{")
        digest.update(memoryview(call.body)[found.end() :])
    else:
        digest.update(b"\n")
        digest.update(call.body)
    json: dict[str, Any] = {BODY_DIGEST: digest.hexdigest()}
    if streamed:  # ``Call.streaming``: the stages hand it on as a stream
        json["stream"] = True
    if found:
        json[REQUEST_ID] = found.group(1).decode()
    return json


def is_keyed(call: Call) -> bool:
    """Whether ``call`` is a server's own call as ``keyed`` keys it."""
    return call.json is not None and BODY_DIGEST in call.json


class NotStored(Exception):
    """An answer that is not to be stored, and why (``reason``, as
    ``gateway_cache_not_stored_total`` counts it)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def stored(call: Call, body: bytes, headers: Headers) -> bytes:
    """The answer ``body`` to ``call`` as its entry stores it: where it echoed the id left
    out of the key, a placeholder.  ``NotStored`` when it is not to be stored: a keyed
    call's stream that did not end well (``ended``: ``unfinished``), an answer whose echoed
    id it frames by length (``id_framed``)."""
    if is_keyed(call) and is_streamed(headers) and not ended(call.path, body):
        raise NotStored("unfinished")
    asked = (call.json or {}).get(REQUEST_ID)
    if asked is None:
        return body
    if any(name.lower() == _FRAMED for name, _ in headers):
        raise NotStored("id_framed")
    wanted = asked.encode()
    for echoed in _ECHO.finditer(body):  # the first that is the caller's
        if echoed.group(1) == wanted:
            return body[: echoed.start(1)] + _PLACEHOLDER + body[echoed.end(1) :]
    return body


def ended(path: str, body: bytes) -> bool:
    """Whether a server's own stream of ``path`` ended as the server ends one well, a
    generation's (``OWN_GREEDY``): llama.cpp's last event ``"stop": true``, Ollama's last
    line ``"done": true``, TGI's last event a ``"generated_text"`` string, SGLang's a
    ``"finish_reason"`` object (then its ``[DONE]``), none after an error, and that last
    piece whole: one JSON object (a server that frames its answer by
    closing the connection and dies within its last event looks done by the words alone).
    Any other server's stream, never (no other keyed path streams)."""
    generation = OWN_GREEDY.get(path)
    if generation is None:
        return False
    text = body.rstrip()
    if generation.trailer:
        text = text.removesuffix(generation.trailer).rstrip()
    last = text.rpartition(generation.separator)[2]
    if generation.last.match(last) is None or generation.failed.search(body) is not None:
        return False
    piece = last.lstrip()
    try:  # the words matched: the piece must be whole too
        return isinstance(json.loads(piece.removeprefix(b"data:")), dict)
    except (ValueError, RecursionError):  # not JSON, or nested past what json reads
        return False


def shares_answers(call: Call) -> bool:
    """Whether calls in flight that differ from ``call`` (as it came) only by their leading id
    may share its answer: none asks for KServe's binary tensors (``binary_data`` in the body,
    a body framed by length), so the answer is JSON whose echoed id can be rewritten."""
    return b'"binary_data' not in call.body and call.header(_FRAMED) is None


def placeheld(call: Call, reply: Reply) -> Reply:
    """``reply`` to a keyed ``call`` with a placeholder where it echoed the call's id, to be
    shared by calls in flight with other ids (each gets its own back, ``answered``); as it
    came when it cannot be rewritten (``rewritable``)."""
    if not rewritable(reply):
        return reply
    try:
        return reply.replace(body=stored(call, reply.body or b"", reply.headers))
    except NotStored:
        return reply


def rewritable(reply: Reply) -> bool:
    """Whether an echoed id can be rewritten in ``reply``: a whole body, neither compressed
    nor framed by length (a call that joined another's flight and got one that is not makes
    its own call)."""
    framed = any(name.lower() == _FRAMED for name, _ in reply.headers)
    return reply.body is not None and not framed and not content_encoded(reply.headers)


def answered(json: dict[str, Any] | None, reply: Reply) -> Reply:
    """A hit's ``reply`` with the caller's own id where the stored answer echoed one."""
    body = reply.body
    if body is None or _PLACEHOLDER not in body:
        return reply
    asked = (json or {}).get(REQUEST_ID, "")
    return reply.replace(body=body.replace(_PLACEHOLDER, asked.encode(), 1))


def sending(call_next: Handler, sent: Call) -> Handler:
    """``call_next``, sending ``sent`` (the call as it came) whatever call it is given: the
    digest is the stage's key, never the next stages' body."""

    async def handler(_: Call) -> Reply:
        return await call_next(sent)

    return handler
