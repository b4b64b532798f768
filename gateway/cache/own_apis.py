"""The model servers' own deterministic calls (``keys.OWN_API_PATH``: KServe V2 / Triton
``infer``, TF Serving ``:predict``, TEI's, llama.cpp's, Ollama's and vLLM's embeddings,
reranking and classification), keyed for the cache and single flight.

Such a call is keyed by its body's bytes, not by its parsed JSON: a tensor of 400,000
numbers (8 MB of JSON) takes a second of the event loop to parse and write canonically,
and 7 ms to hash, and a client sends the same inputs as the same bytes.  The headers that
say how to read the bytes are keyed with them (``FRAMING_HEADERS``: KServe's binary tensor
extension, a compressed body).  The stage sees the call with ``json`` holding only that
digest (``keyed``), never the next stages: the call goes on as it came (``sending``).
"""

from __future__ import annotations

import dataclasses
import hashlib

from gateway.cache.keys import OWN_API_PATH
from gateway.pipeline import Call, Handler, Reply

BODY_DIGEST = "\x00body-sha256"
"""The one member of a keyed call's ``json``: no server's JSON names a member so."""
FRAMING_HEADERS = ("content-type", "content-encoding", "inference-header-content-length")
"""Request headers that change what a body's bytes mean, keyed with them."""


def keyed(call: Call) -> Call | None:
    """``call`` with ``json`` holding its body's digest, when it is a server's own
    deterministic call; else None."""
    if call.json is not None or call.method != "POST" or not OWN_API_PATH.fullmatch(call.path):
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
