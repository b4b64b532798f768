"""Whether the mirror answered a call as the route's backend did (``agree``): the JSON
answers without the fields two servers' answers differ in whatever they say (ids, times,
the model's name, token counts, server timings) are the same, in one canonical form; and
two embeddings answers agree when each input's vectors point the same way (cosine at least
``SAME_COSINE``), since another GPU, kernel or batch size moves the last bits of every
float.

Numbers agree within ``SAME_REL_TOL`` of each other (``SAME_ABS_TOL`` near 0): another GPU,
kernel or batch size moves the last bits of a model's outputs too, a KServe model's scores
as an answer's logprobs.

Only a deterministic call's answers are compared (the cache's test: temperature 0, one
choice, an embedding; the servers' own calls whose answer their body decides,
``own_apis.OWN_API_PATH``: a KServe V2 ``infer``, TEI's ``/embed``, unless the route's
``cache.own_apis`` is off), both whole bodies of at most ``MAX_COMPARED_BYTES``; a sampled
answer differs by design, and a bigger one would hold the event loop to parse.  A streamed
chat or text completion is compared as the answer its events assemble into (``assembled``:
the text, tool calls, logprobs and finish reason of each choice), once both streams have
ended whole: two servers split the same tokens into chunks differently.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

from gateway.cache import own_apis
from gateway.cache.keys import cacheability
from gateway.cache.own_apis import OWN_API_PATH
from gateway.errors import RequestError
from gateway.openai.body import loads
from gateway.openai.sse import StreamRecorder, events_to_json, is_event_stream
from gateway.pipeline import Call, Reply

MAX_COMPARED_BYTES = 256 * 1024
STREAMED_PATHS = ("/v1/chat/completions", "/v1/completions")
"""The streams ``assembled`` reads (OpenAI's chunks)."""
SAME_COSINE = 0.999
"""Two vectors of one input this close are one answer (float16 against float32 weights
keeps above 0.9999; another model is far below)."""
SAME_REL_TOL = 1e-3
SAME_ABS_TOL = 1e-6
"""Two numbers this close are one (float16 against float32 outputs differ by about 5e-4)."""
VOLATILE = frozenset(
    {
        "id",
        "created",
        "created_at",
        "model",
        "system_fingerprint",
        "usage",
        "timings",  # llama.cpp's
        "service_tier",
        "model_name",  # KServe V2's: the mirror is another model, or another version of it
        "model_version",
    }
)
"""Fields in which two servers' answers to one call differ whatever they say."""


def comparable(call: Call, reply: Reply) -> bytes | None:
    """The body of ``reply`` if it is one to compare the mirror's with, else None."""
    body = reply.body
    if reply.status != 200 or body is None or len(body) > MAX_COMPARED_BYTES:
        return None
    if call.json is None:  # a server's own call: compared when its body decides its answer
        own = call.method == "POST" and OWN_API_PATH.fullmatch(call.path) is not None
        return body if own and own_apis.taken(call.route) else None
    if call.streaming or not cacheability(call.json, call.path).ok:
        return None
    return body


def comparable_stream(call: Call, reply: Reply) -> bool:
    """Whether ``reply`` is a deterministic call's stream of OpenAI chunks, to compare."""
    if reply.status != 200 or reply.stream is None or not is_event_stream(reply.headers):
        return False
    if call.json is None or not call.streaming or call.path not in STREAMED_PATHS:
        return False
    return cacheability(call.json, call.path).ok


def assembled(events: tuple[str, ...] | None = None, data: bytes | None = None) -> bytes | None:
    """A stream's ``events`` (or its bytes, ``data``) as the JSON answer they assemble
    into; None for a stream cut, refused by ``StreamRecorder`` or past
    ``MAX_COMPARED_BYTES``."""
    if data is not None:
        recorder = StreamRecorder(MAX_COMPARED_BYTES)
        recorder.feed(data)
        events = recorder.result()
    if events is None:
        return None
    try:
        return json.dumps(events_to_json(events)).encode()
    except (ValueError, TypeError, AttributeError, KeyError):
        return None


def agree(ours: bytes, theirs: bytes) -> bool | None:
    """Whether two answers to one call say the same; None when either cannot be read."""
    if len(ours) > MAX_COMPARED_BYTES or len(theirs) > MAX_COMPARED_BYTES:
        return None
    try:  # strict and bounded (at most MAX_DEPTH deep): a broken server's answer is not read
        a, b = loads(ours), loads(theirs)
    except RequestError:
        return None
    ours_vectors, theirs_vectors = _vectors(a), _vectors(b)
    if ours_vectors is not None and theirs_vectors is not None:
        return _same_directions(ours_vectors, theirs_vectors)
    return _same(a, b)


def _same(a: Any, b: Any) -> bool:
    """Whether two parsed JSON values are one: ``VOLATILE`` members aside, numbers within
    the tolerances, the rest equal."""
    kind = type(a)
    if kind is type(b):
        if kind is dict:
            keys = a.keys() - VOLATILE
            return keys == b.keys() - VOLATILE and all(_same(a[k], b[k]) for k in keys)
        if kind is list:
            return len(a) == len(b) and all(map(_same, a, b))
        if a == b:
            return True
    if float in (kind, type(b)) and {kind, type(b)} <= _NUMBERS:
        return math.isclose(a, b, rel_tol=SAME_REL_TOL, abs_tol=SAME_ABS_TOL)
    return False


_NUMBERS = {int, float}


def _vectors(answer: Any) -> list[np.ndarray] | None:
    """An embeddings answer's vectors in input order (floats, or OpenAI's base64)."""
    if not isinstance(answer, dict) or answer.get("object") != "list":
        return None
    data = answer.get("data")
    if not isinstance(data, list) or not data:
        return None
    import numpy as np  # here: a gateway that compares no embeddings never loads numpy

    found = []
    for item in sorted(data, key=lambda d: d.get("index", 0) if isinstance(d, dict) else 0):
        vector = item.get("embedding") if isinstance(item, dict) else None
        try:
            if isinstance(vector, str):
                found.append(np.frombuffer(base64.b64decode(vector), dtype="<f4"))
            elif isinstance(vector, list):
                found.append(np.asarray(vector, dtype=np.float64))
            else:
                return None
        except (ValueError, TypeError, binascii.Error):
            return None
    return found


def _same_directions(ours: list[np.ndarray], theirs: list[np.ndarray]) -> bool:
    import numpy as np

    if len(ours) != len(theirs):
        return False
    for a, b in zip(ours, theirs, strict=True):
        if a.shape != b.shape or a.ndim != 1:
            return False
        norms = float(np.linalg.norm(a) * np.linalg.norm(b))
        if not norms or float(np.dot(a, b)) / norms < SAME_COSINE:
            return False
    return True
