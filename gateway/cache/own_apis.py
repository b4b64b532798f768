"""The model servers' own deterministic calls (``OWN_API_PATH``: KServe V2 / Triton
``infer``, TF Serving ``:predict``, TEI's, llama.cpp's, Ollama's and vLLM's embeddings,
reranking and classification; ``OWN_GREEDY``: llama.cpp's and Ollama's generations
asked greedy and whole), keyed for the cache and single flight.

Such a call is keyed by its body's bytes, not by its parsed JSON: a tensor of 400,000
numbers (8 MB of JSON) takes a second of the event loop to parse and write canonically,
and 7 ms to hash, and a client sends the same inputs as the same bytes.  The headers that
say how to read the bytes are keyed with them (``FRAMING_HEADERS``: KServe's binary tensor
extension, a compressed body).  The stage sees the call with ``json`` holding only that
digest (``keyed``), never the next stages: the call goes on as it came (``sending``).
A generation's body is read (strict JSON, bounded as every body the gateway reads) only to
tell whether it asks a greedy answer, whole; one the gateway cannot read is not cached.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Mapping
from typing import Any

from gateway.errors import RequestError
from gateway.openai.body import native_object
from gateway.pipeline import Call, Handler, Reply

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
OWN_GREEDY = {
    "/completion": "temperature",  # llama.cpp's: at or below 0, greedy
    "/completions": "temperature",
    "/infill": "temperature",
    "/api/generate": "options.temperature",  # Ollama's
    "/api/chat": "options.temperature",
}
"""The servers' own generation paths, where each names its temperature: a call asking a
greedy answer, whole (``greedy_whole``), is cached as ``OWN_API_PATH``'s are."""


def greedy_whole(body: Mapping[str, Any], path: str) -> bool:
    """Whether a call to ``path`` (``OWN_GREEDY``) asks a greedy answer, whole: its
    temperature a number at or below 0, and no stream (Ollama streams unless ``stream`` is
    false; llama.cpp unless it is true)."""
    outer, _, inner = OWN_GREEDY[path].rpartition(".")
    holder = body.get(outer) if outer else body
    temperature = holder.get(inner) if isinstance(holder, Mapping) else None
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        return False
    stream = body.get("stream")
    whole = stream is False if path.startswith("/api/") else stream in (None, False)
    return temperature <= 0 and whole


BODY_DIGEST = "\x00body-sha256"
"""The one member of a keyed call's ``json``: no server's JSON names a member so."""
FRAMING_HEADERS = ("content-type", "content-encoding", "inference-header-content-length")
"""Request headers that change what a body's bytes mean, keyed with them."""


async def keyed(call: Call) -> Call | None:
    """``call`` with ``json`` holding its body's digest, when it is a server's own
    deterministic call; else None."""
    if call.json is not None or call.method != "POST":
        return None
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
        if not greedy_whole(data, call.path):
            return None
    elif not OWN_API_PATH.fullmatch(call.path):
        return None
    digest = hashlib.sha256()
    for name, value in call.headers:  # every value, in order: a server may read any
        if name.lower() in FRAMING_HEADERS:
            digest.update(f"{name.lower()}:{value}\n".encode(errors="surrogateescape"))
    digest.update(b"\n" + call.body)
    return dataclasses.replace(call, json={BODY_DIGEST: digest.hexdigest()})


def sending(call_next: Handler, sent: Call) -> Handler:
    """``call_next``, sending ``sent`` (the call as it came) whatever call it is given: the
    digest is the stage's key, never the next stages' body."""

    async def handler(_: Call) -> Reply:
        return await call_next(sent)

    return handler
