"""The model servers' own deterministic calls (``keys.OWN_API_PATH``: KServe V2 / Triton
``infer``, TF Serving ``:predict``, TEI's, llama.cpp's, Ollama's and vLLM's embeddings,
reranking and classification), read for the cache and single flight.

The edge parses only OpenAI's and Anthropic's bodies; on a route that caches with
``cache.own_apis``, a call of one of these has its body read here, for its key alone, and
goes on upstream as it came, byte for byte (``sending``).  A body the gateway cannot read
(compressed, not one JSON object, KServe's binary tensor extension) is passed on
uncached: the backend judges it.
"""

from __future__ import annotations

import dataclasses

from gateway.cache.keys import OWN_API_PATH
from gateway.errors import RequestError
from gateway.openai.body import native_object
from gateway.pipeline import Call, Handler, Reply


async def keyed(call: Call) -> Call | None:
    """``call`` with its body read into ``json`` when it is a server's own deterministic
    call whose body is one JSON object; else None."""
    if call.json is not None or call.method != "POST" or not OWN_API_PATH.fullmatch(call.path):
        return None
    try:
        data = await native_object(
            call.body,
            call.header("Content-Encoding"),
            call.policy.server.max_json_values,
            "the cache",
        )
    except RequestError:
        return None
    return dataclasses.replace(call, json=data)


def sending(call_next: Handler, sent: Call) -> Handler:
    """``call_next``, sending ``sent`` (the call as it came) whatever call it is given: the
    body read for a key is the stage's, never the next stages'."""

    async def handler(_: Call) -> Reply:
        return await call_next(sent)

    return handler
