"""A greedy generation asked of a server's own API as a stream (llama.cpp's ``/completion``
with ``stream: true``, Ollama's ``/api/chat`` and ``/api/generate``, which stream unless
told not to, TGI's ``/generate_stream`` and ``/`` with ``stream: true``) is cached as it came (``cache.own_apis``, ``gateway/cache/own_apis.py``): stored
once it has ended as the server ends a stream well, replayed byte for byte, and shared by
single flight while in flight.  Before, every such call passed a caching route uncached
(``X-Gateway-Cache: bypass``): Ollama's default, whatever its temperature."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.cache.own_apis import (
    OWN_GREEDY,
    ended,
    greedy,
    sglang_greedy,
    streams,
    tgi_greedy,
)
from gateway.pipeline import Reply
from gateway.testing import Sent, stream_reply
from tests.helpers import policy, until
from tests.test_cache_own_apis import Model

URL = "http://main.test"
ALICE = [("Authorization", "Bearer sk-alice")]
BOB = [("Authorization", "Bearer sk-bob")]
NDJSON = "application/x-ndjson"
NOT_STORED = "gateway_cache_not_stored_total"
LLAMA = (  # llama.cpp's /completion stream: its events, the last with "stop"
    b'data: {"index":0,"content":" Paris","tokens":[7127],"stop":false}\n\n',
    b'data: {"index":0,"content":".","stop":true,"tokens_predicted":2,"stop_type":"limit"}\n\n',
)
OLLAMA = (  # Ollama's /api/chat stream: a JSON object a line, the last one "done"
    b'{"model":"gemma3","message":{"role":"assistant","content":"Paris"},"done":false}\n',
    b'{"model":"gemma3","message":{"role":"assistant","content":""},"done":true,'
    b'"done_reason":"stop","eval_count":2}\n',
)
TGI = (  # TGI's /generate_stream: a token an event, the last with the whole text
    b'data:{"index":0,"token":{"id":7,"text":" Paris","logprob":-0.1,"special":false},'
    b'"generated_text":null,"details":null}\n\n',
    b'data:{"index":1,"token":{"id":8,"text":".","logprob":-0.2,"special":false},'
    b'"generated_text":" Paris.","details":null}\n\n',
)
TGI_GREEDY = {"inputs": "Paris is", "parameters": {"max_new_tokens": 2, "temperature": None}}
SGLANG = (  # SGLang's /generate stream: the text so far, the last naming why it finished
    b'data: {"text":" Paris","output_ids":[7],"meta_info":{"id":"r1","finish_reason":null,'
    b'"prompt_tokens":3,"completion_tokens":1}}\n\n',
    b'data: {"text":" Paris.","output_ids":[7,8],"meta_info":{"id":"r1","finish_reason":'
    b'{"type":"length","length":2},"prompt_tokens":3,"completion_tokens":2}}\n\n',
    b"data: [DONE]\n\n",
)
SGLANG_GREEDY = {"text": "Paris is", "sampling_params": {"temperature": 0}, "stream": True}
GREEDY_STREAMS = [
    ("/completion", {"prompt": "Paris is", "temperature": 0, "stream": True}, LLAMA, "sse"),
    (  # an older llama.cpp ended its stream with a [DONE]
        "/infill",
        {"input_prefix": "def f(", "temperature": 0, "stream": True},
        (*LLAMA, b"data: [DONE]\n\n"),
        "sse",
    ),
    ("/api/chat", {"model": "gemma3", "messages": [], "options": {"temperature": 0}}, OLLAMA, "nd"),
    (
        "/api/generate",
        {"model": "gemma3", "prompt": "p", "stream": True, "options": {"temperature": 0}},
        OLLAMA,
        "nd",
    ),
    ("/generate_stream", TGI_GREEDY, TGI, "sse"),
    ("/", {**TGI_GREEDY, "stream": True}, TGI, "sse"),  # TGI's route for its Python clients
    ("/generate", SGLANG_GREEDY, SGLANG, "sse"),  # SGLang's; TGI's /generate never streams
]


class Streaming(Model):
    """A model server answering every call with ``chunks`` as a stream (``cut``: the
    connection breaks after the first), holding calls while ``gate`` is closed."""

    def __init__(self, chunks: Sequence[bytes], kind: str, cut: bool = False) -> None:
        super().__init__()
        self.chunks, self.cut = chunks, cut
        self.content_type = NDJSON if kind == "nd" else "text/event-stream"

    def answer(self, sent: Sent) -> Reply:
        return stream_reply(self._relay(), content_type=self.content_type)

    async def _relay(self) -> AsyncIterator[bytes]:
        for n, chunk in enumerate(self.chunks):
            if self.cut and n == 1:
                raise ConnectionResetError("the server went away")
            yield chunk


async def gateway(pipeline: Any, model: Streaming, **cache: Any) -> Any:
    routes = {"match": {"path": "*"}, "cache": {"ttl_s": 60, **cache}}
    return await pipeline(policy({"main": {"url": URL}}, routes), model)


@pytest.mark.parametrize(("path", "body", "chunks", "kind"), GREEDY_STREAMS)
async def test_a_greedy_stream_is_replayed_byte_for_byte(pipeline, path, body, chunks, kind):
    model = Streaming(chunks, kind)
    gw = await gateway(pipeline, model)
    first = await gw.post(path, body, headers=ALICE)
    again = await gw.post(path, body, headers=ALICE)
    assert [first.headers["X-Gateway-Cache"], again.headers["X-Gateway-Cache"]] == ["miss", "hit"]
    assert first.body == again.body == b"".join(chunks)
    assert again.headers["Content-Type"] == model.content_type
    assert len(model.bodies) == 1
    other = await gw.post(path, body, headers=BOB)  # another tenant: its own call
    assert other.headers["X-Gateway-Cache"] == "miss" and len(model.bodies) == 2


ENDED_BADLY = [
    ("sse", LLAMA[:1]),  # cut between events: its last not "stop"
    ("sse", (LLAMA[0], b'data: {"error":{"code":500,"message":"out of memory"}}\n\n')),
    ("sse", (LLAMA[0], b'data: {"error":{"code":500}}\n\n', LLAMA[1])),
    ("sse", (LLAMA[1], LLAMA[0])),
    ("sse", (LLAMA[0], b'data: {"content":"\\"stop\\":true","stop":false}\n\n')),
    ("nd", OLLAMA[:1]),  # its last line not done
    ("nd", (OLLAMA[0], b'{"error":"model runner has unexpectedly stopped"}\n')),
    ("nd", (b'{"error":"x"}\n', OLLAMA[1])),
    ("nd", (OLLAMA[0], OLLAMA[1].replace(b'"done":true', b'"done":false'))),
    ("nd", (OLLAMA[0], b'{"response":"\\"done\\":true"}\n')),  # only its text says so
    ("tgi", TGI[:1]),  # its last event's generated_text null
    ("tgi", (TGI[0], b'data:{"error":"Request failed during generation","error_type":"x"}\n\n')),
    ("tgi", (b'data:{"error":"x","error_type":"generation"}\n\n', TGI[1])),
    ("tgi", (TGI[0], TGI[0].replace(b"Paris", b'\\"generated_text\\":\\"'))),  # its text
    ("tgi", (TGI[0], TGI[1][: TGI[1].index(b"Paris.")])),  # its last event cut short
    ("sglang", SGLANG[:1] + SGLANG[2:]),  # [DONE] after an event still going
    ("sglang", (SGLANG[0], b'data: {"error":{"message":"out of memory"}}\n\n', SGLANG[2])),
    ("sglang", (SGLANG[0], SGLANG[1][: SGLANG[1].index(b'"prompt_tokens":3,"c')])),
    ("sglang", (SGLANG[0], b'data: {"text":"\\"finish_reason\\":{","meta_info":{}}\n\n')),
    ("sse", (LLAMA[0], LLAMA[1][: LLAMA[1].index(b"tokens_predicted")])),
    ("nd", (OLLAMA[0], OLLAMA[1][: OLLAMA[1].index(b"eval_count")])),
]


@pytest.mark.parametrize(("kind", "chunks"), ENDED_BADLY)
async def test_a_stream_that_did_not_end_well_is_not_stored(pipeline, kind, chunks):
    """A stream is stored only once it has ended as its server ends one well: llama.cpp's
    ``data: [DONE]``, Ollama's last line ``"done": true``, neither after an error."""
    path, body = {
        "sse": GREEDY_STREAMS[0],
        "nd": GREEDY_STREAMS[2],
        "tgi": GREEDY_STREAMS[4],
        "sglang": GREEDY_STREAMS[6],
    }[kind][:2]
    model = Streaming(chunks, kind)
    gw = await gateway(pipeline, model)
    for _ in range(2):
        answer = await gw.post(path, body, headers=ALICE)
        assert answer.headers["X-Gateway-Cache"] == "miss"
        assert answer.body == b"".join(chunks)  # relayed as the server sent it
    assert len(model.bodies) == 2
    assert gw.metric(NOT_STORED, route="chat", reason="unfinished") == 2


@pytest.mark.parametrize(("path", "body", "chunks", "kind"), GREEDY_STREAMS)
async def test_a_stream_cut_off_is_not_stored(pipeline, path, body, chunks, kind):
    model = Streaming(chunks, kind, cut=True)
    gw = await gateway(pipeline, model)
    for _ in range(2):
        answer = await gw.post(path, body, headers=ALICE)
        assert answer.headers["X-Gateway-Cache"] == "miss" and not answer.complete
    assert len(model.bodies) == 2
    assert gw.metric(NOT_STORED, route="chat", reason="unfinished") == 2


async def test_a_stream_and_a_whole_answer_never_share_an_entry(pipeline):
    """The same greedy question asked streamed and whole: two entries, each replayed in its
    own shape (the body's bytes key it, ``stream`` among them)."""
    model = Streaming(LLAMA, "sse")
    gw = await gateway(pipeline, model)
    streamed = {"prompt": "Paris is", "temperature": 0, "stream": True}
    whole = {"prompt": "Paris is", "temperature": 0}
    states = [
        (await gw.post("/completion", asked, headers=ALICE)).headers["X-Gateway-Cache"]
        for asked in (streamed, whole, streamed)
    ]
    assert states == ["miss", "miss", "hit"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/completion", {"prompt": "p", "temperature": 0.7, "stream": True}),
        ("/completion", {"prompt": "p", "stream": True}),  # llama.cpp samples unless told
        ("/api/chat", {"model": "m", "messages": []}),  # Ollama's default temperature
        ("/api/generate", {"model": "m", "options": {"temperature": 0.2}}),
        ("/generate_stream", {"inputs": "p", "parameters": {"do_sample": True}}),
        ("/generate_stream", {"inputs": "p", "parameters": {"temperature": 0.5}}),
        ("/generate_stream", {"inputs": "p", "parameters": {"top_k": 1}}),  # sampled, as TGI's
        ("/", {"inputs": "p", "stream": True, "parameters": {"top_p": 0.9}}),
        ("/generate_stream", {"inputs": "p", "parameters": {"best_of": 2}}),
        ("/generate_stream", {"inputs": "p", "parameters": "greedy"}),  # not TGI's
        ("/generate_stream", {"inputs": "p", "parameters": {"do_sample": "no"}}),
        ("/generate_stream", {"text": "p", "sampling_params": {"temperature": 0}}),  # SGLang's
        ("/generate", {"text": "p", "stream": True}),  # SGLang samples at 1.0 unless told
        ("/generate", {"text": "p", "sampling_params": {"temperature": 0.3}, "stream": True}),
        (  # a session's answer depends on its earlier turns
            "/generate",
            {**SGLANG_GREEDY, "session_params": {"id": "s1"}},
        ),
        ("/generate", {**SGLANG_GREEDY, "sampling_params": [{"temperature": 0}]}),
    ],
)
async def test_a_sampled_stream_is_not_cached(pipeline, path, body):
    model = Streaming(LLAMA if path == "/completion" else OLLAMA, "sse")
    gw = await gateway(pipeline, model)
    for _ in range(2):
        assert (await gw.post(path, body, headers=ALICE)).headers["X-Gateway-Cache"] == "bypass"
    assert len(model.bodies) == 2


async def test_own_apis_false_leaves_streams_uncached(pipeline):
    model = Streaming(OLLAMA, "nd")
    gw = await gateway(pipeline, model, own_apis=False)
    path, body = GREEDY_STREAMS[2][:2]
    for _ in range(2):
        assert (await gw.post(path, body, headers=ALICE)).headers["X-Gateway-Cache"] == "bypass"
    assert len(model.bodies) == 2


@pytest.mark.parametrize(("path", "body", "chunks", "kind"), GREEDY_STREAMS)
async def test_identical_greedy_streams_in_flight_share_one_call(
    pipeline, path, body, chunks, kind
):
    """Three callers of one greedy stream while the first is in flight: one upstream call,
    each caller the whole stream as the server sent it."""
    model = Streaming(chunks, kind)
    model.gate = asyncio.Event()
    gw = await gateway(pipeline, model)
    calls = [asyncio.ensure_future(gw.post(path, body, headers=ALICE)) for _ in range(3)]
    await until(lambda: len(model.bodies) == 1)
    await asyncio.sleep(0.05)  # the others have joined the flight by now
    model.gate.set()
    answers = await asyncio.gather(*calls)
    assert len(model.bodies) == 1
    assert [a.body for a in answers] == [b"".join(chunks)] * 3
    assert sum(a.headers.get("X-Gateway-Coalesced") == "1" for a in answers) == 2


@pytest.mark.llm
async def test_llama_cpps_own_greedy_stream_is_answered_from_the_cache(
    llama, start_gateway, tmp_path
):
    """The real server (llama.cpp, Gemma 3 270M): a greedy ``/completion`` streamed twice is
    generated once, the second replayed from the cache byte for byte."""
    import httpx

    from tests.helpers import write_policy

    route = {"name": "llm", "match": {"path": "*"}, "backend": "llm", "cache": {"ttl_s": 60}}
    doc = {"backends": {"llm": {"url": llama.url}}, "routes": [route]}
    gw = await start_gateway(policy=write_policy(tmp_path, doc))
    asked = {"prompt": "The capital of France is", "n_predict": 6, "temperature": 0}
    async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
        first = await client.post("/completion", json={**asked, "stream": True})
        again = await client.post("/completion", json={**asked, "stream": True})
    assert [r.headers["X-Gateway-Cache"] for r in (first, again)] == ["miss", "hit"]
    assert again.headers["Content-Type"].startswith("text/event-stream")
    assert again.content == first.content
    assert b'"stop":true' in first.content.rpartition(b"\n\ndata: ")[2]  # its last event


def ollama_chat(question: str, **more: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": question}]
    return {"model": "gemma3", "messages": messages, "options": {"temperature": 0}, **more}


async def test_ollamas_chat_takes_the_near_duplicate_tiers(pipeline):
    """Ollama's ``/api/chat`` has OpenAI's messages: on a route with ``semantic``, a greedy
    question written otherwise is a SimHash hit, as chat's are, in its own shape (streamed
    or whole), within its tenant; a different question is not."""
    model = Streaming(OLLAMA, "nd")
    gw = await gateway(pipeline, model, semantic={"method": "simhash"})
    first = await gw.post("/api/chat", ollama_chat("What is the capital of France?"), headers=ALICE)
    near = await gw.post("/api/chat", ollama_chat("what is the capital of france ?"), headers=ALICE)
    assert [first.headers["X-Gateway-Cache"], near.headers["X-Gateway-Cache"]] == ["miss", "hit"]
    assert near.headers["X-Gateway-Cache-Match"] == "simhash" and near.body == first.body
    assert near.headers["Content-Type"] == NDJSON
    asked = [
        ("What is the capital of Spain?", {}, ALICE),  # another question
        ("what is the capital of france ?", {"stream": False}, ALICE),  # another shape
        ("what is the capital of france ?", {}, BOB),  # another tenant
    ]
    for question, more, who in asked:
        answer = await gw.post("/api/chat", ollama_chat(question, **more), headers=who)
        assert answer.headers["X-Gateway-Cache"] == "miss", question
    assert len(model.bodies) == 4


async def test_ollamas_chat_keys_by_its_json_and_its_stream_as_ollama_reads_it(pipeline):
    """Keyed by its JSON: the same question with its fields in another order, or asking
    ``stream: true`` (Ollama's default) outright, is the same call."""
    model = Streaming(OLLAMA, "nd")
    gw = await gateway(pipeline, model)
    body = ollama_chat("Which jacket keeps the rain out?")
    await gw.post("/api/chat", body, headers=ALICE)
    reordered = json.dumps(dict(reversed(list({**body, "stream": True}.items())))).encode()
    again = await gw.request("POST", "/api/chat", body=reordered, headers=ALICE)
    assert again.headers["X-Gateway-Cache"] == "hit" and len(model.bodies) == 1


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=8,
)
GREEDY_KEYS = ["inputs", "parameters", "do_sample", "temperature", "top_k", "best_of", "stream"]


@settings(max_examples=300, deadline=None, database=None)
@given(
    body=st.dictionaries(
        st.sampled_from(GREEDY_KEYS),
        JSONISH | st.dictionaries(st.sampled_from(GREEDY_KEYS), JSONISH),
    ),
    path=st.sampled_from(sorted(OWN_GREEDY)),
    tail=st.binary(max_size=40),
)
def test_whatever_a_body_or_an_answer_holds_the_checks_answer_yes_or_no(body, path, tail):
    """The greedy and stream checks are total: any body, any bytes after a well-ended
    stream's words, a last event nested past what ``json`` reads: a bool, never an error."""
    assert isinstance(greedy(body, path), bool) and isinstance(streams(body, path), bool)
    for last in (TGI[1], LLAMA[1], OLLAMA[1], SGLANG[1]):
        assert isinstance(ended(path, last.rstrip() + tail), bool)
    nested = b'data: {"stop": true, "generated_text": "", "done": true, "a": ' + b'{"a":' * 5000
    assert ended(path, nested) is False and ended(path, nested[6:]) is False


def test_sglangs_greedy_rule_and_its_stream_at_the_path_tgi_shares():
    """SGLang decodes greedily at a temperature of 0 (its default is 1.0; the gateway takes
    no temperature above 0 for greedy, though SGLang's epsilon is 1e-6);
    ``/generate`` is TGI's too, told apart by the prompt's field, and only SGLang's streams
    there."""
    assert sglang_greedy({"text": "p", "sampling_params": {"temperature": 0}})
    assert sglang_greedy({"input_ids": [1], "sampling_params": {"temperature": 0.0, "n": 2}})
    for sampled in (
        {"text": "p"},
        {"text": "p", "sampling_params": {"temperature": 0.01}},
        {"text": "p", "sampling_params": {"temperature": False}},
        {"text": "p", "inputs": "p", "sampling_params": {"temperature": 0}},
        {"prompt": "p", "sampling_params": {"temperature": 0}},  # vLLM's demonstration's
    ):
        assert not sglang_greedy(sampled)
    assert streams(SGLANG_GREEDY, "/generate")
    assert not streams({**TGI_GREEDY, "stream": True}, "/generate")  # TGI's: never
    assert greedy(TGI_GREEDY, "/generate") and greedy(SGLANG_GREEDY, "/generate")


def test_tgis_greedy_rule_reads_sampling_as_its_router_does():
    """TGI's router: ``parameters`` absent are filled in with ``do_sample: true``; given,
    ``do_sample`` defaults to false, and any of temperature, top_k, top_p or typical_p set
    makes it sample."""
    assert tgi_greedy({"inputs": "p", "parameters": {}})
    assert tgi_greedy({"inputs": "p", "parameters": {"temperature": None, "seed": 4}})
    assert not tgi_greedy({"inputs": "p"}) and not tgi_greedy({"inputs": "p", "parameters": None})
    for sampled in ({"do_sample": True}, {"temperature": 1.0}, {"top_k": 0}, {"best_of": 2}):
        assert not tgi_greedy({"inputs": "p", "parameters": sampled})
