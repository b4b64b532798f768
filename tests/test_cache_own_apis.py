"""The model servers' own deterministic calls are cached and shared by single flight
(``cache.own_apis``, ``gateway/cache/own_apis.py``): KServe V2 / Triton ``infer``, TF
Serving ``:predict``, TEI's ``/embed`` and ``/rerank``, llama.cpp's ``/embedding``,
Ollama's ``/api/embed``, vLLM's ``/pooling`` and ``/score``.  Each is keyed by its body's
bytes (and the headers framing them), within the tenant's scope and the backend's model
version, and goes upstream as it came, byte for byte.  Before, every one of them passed a caching route uncached
(``X-Gateway-Cache: bypass``), the case study's recommendation model (KServe V2) among
them."""

from __future__ import annotations

import asyncio
import json
import zlib
from typing import Any

import pytest

from gateway.cache.keys import request_key
from gateway.cache.own_apis import OWN_API_PATH
from gateway.pipeline import Reply
from gateway.testing import Sent, json_reply
from tests.helpers import policy, until

URL = "http://main.test"
INFER = "/v2/models/recommender/infer"
ALICE = [("Authorization", "Bearer sk-alice")]
BOB = [("Authorization", "Bearer sk-bob")]


def infer(row: list[float], **more: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": row}], **more}


class Model:
    """A model server answering each call with a new answer (its number), holding calls
    while ``gate`` is closed; ``bodies`` holds the raw bodies it was sent."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.gate: asyncio.Event | None = None

    async def __call__(self, sent: Sent) -> Reply:
        self.bodies.append(sent.body)
        if self.gate is not None:
            await self.gate.wait()
        return self.answer(sent)

    def answer(self, sent: Sent) -> Reply:
        data = [float(len(self.bodies))]
        output = {"name": "y", "shape": [1, 1], "datatype": "FP32", "data": data}
        return json_reply({"model_name": "recommender", "outputs": [output]})


async def gateway(pipeline: Any, cache: dict[str, Any] | None = None, **route: Any):
    model = Model()
    routes = {"match": {"path": "*"}, "cache": {"ttl_s": 60, **(cache or {})}, **route}
    gw = await pipeline(policy({"main": {"url": URL}}, routes), model)
    return gw, model


@pytest.mark.parametrize("semantic", ["off", "simhash"])
async def test_a_kserve_inference_is_answered_from_the_cache(pipeline, semantic):
    """Whatever the route's near-duplicate tier: it compares chat prompts, not tensors."""
    gw, model = await gateway(pipeline, {"semantic": {"method": semantic}})
    first = await gw.post(INFER, infer([1, 2, 3]), headers=ALICE)
    again = await gw.post(INFER, infer([1, 2, 3]), headers=ALICE)
    assert first.headers["X-Gateway-Cache"] == "miss"
    assert again.headers["X-Gateway-Cache"] == "hit"
    assert again.json() == first.json() and len(model.bodies) == 1
    other = await gw.post(INFER, infer([1, 2, 4]), headers=ALICE)
    assert other.headers["X-Gateway-Cache"] == "miss" and other.json() != first.json()


@pytest.mark.parametrize(
    "change",
    [
        {"id": "req-2"},  # after the inputs: in the key (one opening the body is not)
        {"parameters": {"binary_data_output": True}},
        {"outputs": [{"name": "y"}]},
    ],
)
async def test_every_field_of_a_servers_own_body_keys_it(pipeline, change):
    gw, model = await gateway(pipeline)
    await gw.post(INFER, infer([1, 2, 3], id="req-1"), headers=ALICE)
    answer = await gw.post(INFER, {**infer([1, 2, 3], id="req-1"), **change}, headers=ALICE)
    assert answer.headers["X-Gateway-Cache"] == "miss" and len(model.bodies) == 2


async def test_another_tenant_and_another_model_never_share_an_entry(pipeline):
    gw, model = await gateway(pipeline)
    await gw.post(INFER, infer([1, 2, 3]), headers=ALICE)
    assert (await gw.post(INFER, infer([1, 2, 3]), headers=BOB)).headers["X-Gateway-Cache"] == (
        "miss"
    )
    elsewhere = await gw.post("/v2/models/ranker/infer", infer([1, 2, 3]), headers=ALICE)
    assert elsewhere.headers["X-Gateway-Cache"] == "miss" and len(model.bodies) == 3


def test_the_backends_model_version_is_in_the_key():
    body = infer([1, 2, 3])
    keys = {
        request_key(body, scope="s", route="r", backend="b", model_version=v, path=INFER).exact
        for v in ("v1", "v2")
    }
    assert len(keys) == 2


async def test_the_call_goes_upstream_as_it_came_and_is_keyed_by_its_bytes(pipeline):
    gw, model = await gateway(pipeline)
    raw = b'{ "inputs" : [ {"name":"x","shape":[1,3],"datatype":"FP32","data":[1.0,2,3]} ] }'
    answer = await gw.request("POST", INFER, body=raw, headers=ALICE)
    assert answer.status_code == 200 and model.bodies == [raw]
    again = await gw.request("POST", INFER, body=raw, headers=ALICE)
    assert again.headers["X-Gateway-Cache"] == "hit"
    compact = json.dumps(json.loads(raw), separators=(",", ":")).encode()
    written = await gw.request("POST", INFER, body=compact, headers=ALICE)
    assert written.headers["X-Gateway-Cache"] == "miss"  # other bytes: another entry
    assert model.bodies == [raw, compact]


@pytest.mark.parametrize(
    ("body", "framing", "other"),
    [
        (
            zlib.compress(json.dumps(infer([1, 2, 3])).encode()),
            [("Content-Encoding", "deflate")],
            [("Content-Encoding", "gzip")],
        ),
        (  # KServe's binary tensor extension: its JSON header's length frames the bytes
            b'{"inputs":[]}\x00\x01\x02\x03',
            [("Inference-Header-Content-Length", "13")],
            [("Inference-Header-Content-Length", "14")],
        ),
        (b"[1, 2, 3]", [("Content-Type", "application/json")], [("Content-Type", "text/csv")]),
        (  # a second value: the server may read either
            b"{}",
            [("Content-Encoding", "identity")],
            [("Content-Encoding", "identity"), ("Content-Encoding", "gzip")],
        ),
    ],
    ids=["compressed", "binary-extension", "any-bytes", "two-values"],
)
async def test_any_body_is_keyed_by_its_bytes_and_the_headers_framing_them(
    pipeline, body, framing, other
):
    """Never parsed: the bytes the server reads, read as the headers say."""
    gw, model = await gateway(pipeline)
    for headers in (framing, framing, other):
        answer = await gw.request("POST", INFER, body=body, headers=ALICE + headers)
        assert answer.status_code == 200
    assert answer.headers["X-Gateway-Cache"] == "miss"
    assert model.bodies == [body, body]


async def test_a_large_tensor_is_keyed_without_being_parsed(pipeline):
    """8 MB of numbers, more values than ``server.max_json_values`` would let a parse read:
    hashed (milliseconds), never parsed and written canonically (a second of the event
    loop, every other call held meanwhile)."""
    gw, model = await gateway(pipeline)
    data = ",".join(["0.123456789"] * 700_000)
    raw = '{"inputs":[{"name":"x","shape":[1,700000],"datatype":"FP32","data":[' + data + "]}]}"
    for expected in ("miss", "hit"):
        answer = await gw.request("POST", INFER, body=raw.encode(), headers=ALICE)
        assert answer.headers["X-Gateway-Cache"] == expected
    assert len(model.bodies) == 1


async def test_own_apis_false_caches_only_openais_and_anthropics(pipeline):
    gw, model = await gateway(pipeline, {"own_apis": False})
    for _ in range(2):
        answer = await gw.post(INFER, infer([1, 2, 3]), headers=ALICE)
        assert answer.headers["X-Gateway-Cache"] == "bypass"
    assert len(model.bodies) == 2


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/models/recommender:predict", {"instances": [[1.0, 2.0]]}),  # TF Serving
        ("/v2/models/recommender/versions/3/infer", infer([1, 2, 3])),
        ("/embed", {"inputs": ["a question"], "normalize": True}),  # TEI
        ("/rerank", {"query": "q", "texts": ["a", "b"]}),  # TEI, llama.cpp
        ("/predict", {"inputs": "a review"}),  # TEI's classifier
        ("/embedding", {"content": "a question"}),  # llama.cpp
        ("/api/embed", {"model": "nomic-embed-text", "input": ["a", "b"]}),  # Ollama
        ("/api/embeddings", {"model": "nomic-embed-text", "prompt": "a"}),  # its older API
        ("/embeddings", {"input": ["a", "b"]}),  # llama.cpp's own: whole, not item by item
        ("/pooling", {"model": "m", "input": "a"}),  # vLLM
        ("/score", {"model": "m", "text_1": "a", "text_2": "b"}),
        # greedy generations asked whole: llama.cpp's
        ("/completion", {"prompt": "Paris is", "n_predict": 8, "temperature": 0}),
        ("/completion", {"prompt": "Paris is", "temperature": -1, "stream": False}),
        ("/completions", {"prompt": ["a", "b"], "temperature": 0.0}),
        ("/infill", {"input_prefix": "def f(", "input_suffix": ")", "temperature": 0}),
        (  # Ollama's: greedy, and asked not to stream
            "/api/chat",
            {"model": "gemma3", "messages": [], "stream": False, "options": {"temperature": 0}},
        ),
        ("/api/generate", {"model": "gemma3", "stream": False, "options": {"temperature": 0}}),
        # TGI's: greedy unless a parameter samples; "/" is where its Python clients post
        ("/generate", {"inputs": "Paris is", "parameters": {"max_new_tokens": 8}}),
        ("/generate", {"inputs": "Paris is", "parameters": {}}),
        ("/", {"inputs": "a", "stream": False, "parameters": {"do_sample": False, "seed": 3}}),
        ("/", {"inputs": "a", "parameters": {"best_of": 1, "temperature": None, "top_k": None}}),
        # SGLang's, at the path TGI's shares: its prompt in text or input_ids
        ("/generate", {"text": "Paris is", "sampling_params": {"temperature": 0}}),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": 0.0, "n": 2}}),
    ],
)
async def test_each_servers_own_deterministic_call_is_cached(pipeline, path, body):
    gw, model = await gateway(pipeline)
    await gw.post(path, body, headers=ALICE)
    assert (await gw.post(path, body, headers=ALICE)).headers["X-Gateway-Cache"] == "hit"
    assert len(model.bodies) == 1


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/completion", {"prompt": "p"}),  # llama.cpp samples at 0.8 unless told
        ("/completion", {"prompt": "p", "temperature": 0.7}),
        ("/completion", {"prompt": "p", "temperature": "0"}),
        ("/api/generate", {"model": "m", "stream": False, "options": {"temperature": 0.1}}),
        ("/api/generate", {"model": "m", "stream": False, "temperature": 0}),  # not Ollama's
        ("/api/chat", {"model": "m", "stream": False, "options": [0]}),
        ("/generate", {"inputs": "p", "parameters": {"do_sample": True}}),  # TGI's
        ("/generate", {"inputs": "p"}),  # without parameters TGI samples: do_sample true
        ("/generate", {"inputs": "p", "parameters": None}),
        ("/generate", {"inputs": "p", "parameters": {"do_sample": None}}),
        ("/generate", {"inputs": "p", "parameters": {"temperature": 1.0}}),
        ("/generate", {"inputs": "p", "parameters": {"typical_p": 0.5}}),
        ("/generate", {"inputs": "p", "parameters": {"best_of": True}}),
        ("/generate", {"inputs": ["p"]}),  # not TGI's
        ("/generate", {"text": "p", "sampling_params": {"temperature": 0.5}}),  # SGLang's
        ("/generate", {"text": "p"}),  # SGLang samples at 1.0 unless told
        ("/generate", {"prompt": "p", "temperature": 0}),  # vLLM's demonstration server's
        ("/", {"inputs": "p", "parameters": {"top_p": 0.5}}),
        ("/", {"model": "m", "prompt": "p"}),  # another server's root
    ],
)
async def test_a_sampled_generation_is_not_cached(pipeline, path, body):
    gw, model = await gateway(pipeline)
    for _ in range(2):
        answer = await gw.post(path, body, headers=ALICE)
        assert answer.headers["X-Gateway-Cache"] == "bypass"
    assert len(model.bodies) == 2


async def test_a_generation_body_the_gateway_cannot_read_is_not_cached(pipeline):
    gw, model = await gateway(pipeline)
    for body in (b"{not json", b'{"temperature": 0, "TEMPERATURE": 1, "prompt": "p"}'):
        for _ in range(2):
            answer = await gw.request("POST", "/completion", body=body, headers=ALICE)
            assert answer.status_code == 200
            assert answer.headers["X-Gateway-Cache"] == "bypass"
    assert len(model.bodies) == 4


@pytest.mark.parametrize(
    "path",
    [
        "/v2/models/m/generate",  # Triton's: its sampling is each backend's own
        "/v2/models/m/infer/extra",
        "/v2/repository/index",
        "/v1/embeddings",  # OpenAI's: cached item by item, by its own rules
    ],
)
def test_only_the_servers_deterministic_calls_are_their_own_apis(path):
    assert OWN_API_PATH.fullmatch(path) is None


def joined(gw: Any) -> float:
    return gw.metric("gateway_coalesced_requests_total", route="chat") or 0.0


async def test_identical_inferences_in_flight_share_one_call(pipeline):
    gw, model = await gateway(pipeline)
    model.gate = asyncio.Event()
    calls = [gw.send("POST", INFER, json=infer([1, 2, 3]), headers=ALICE) for _ in range(3)]
    other = gw.send("POST", INFER, json=infer([1, 2, 3]), headers=BOB)  # another tenant's
    await until(lambda: len(model.bodies) == 2 and joined(gw) == 2)
    model.gate.set()
    answers = [await call.done() for call in calls]
    assert len(model.bodies) == 2
    assert sum(a.headers.get("X-Gateway-Coalesced") == "1" for a in answers) == 2
    assert len({json.dumps(a.json()) for a in answers}) == 1
    assert (await other.done()).status_code == 200


async def test_a_route_that_coalesces_without_a_cache_shares_them_too(pipeline):
    model = Model()
    route = {"match": {"path": "*"}, "coalesce": True}
    gw = await pipeline(policy({"main": {"url": URL}}, route), model)
    model.gate = asyncio.Event()
    calls = [gw.send("POST", "/embed", json={"inputs": ["q"]}, headers=ALICE) for _ in range(2)]
    await until(lambda: len(model.bodies) == 1 and joined(gw) == 1)
    model.gate.set()
    assert [(await c.done()).status_code for c in calls] == [200, 200]
    assert len(model.bodies) == 1


async def test_whatever_is_sent_a_hit_is_only_ever_the_callers_own_answer(pipeline):
    """300 calls drawn (a fixed seed) from bodies alike but for a byte, framings and
    tenants: each is answered what the server answers its own bytes, framing and
    credential, and from the cache exactly when that triple was asked before."""
    import hashlib
    import random

    def echo(sent: Sent) -> Reply:
        framing = sent.header("Content-Encoding") or ""
        seen = sent.body + framing.encode() + (sent.header("Authorization") or "").encode()
        return json_reply({"echo": hashlib.sha256(seen).hexdigest()})

    route = {"match": {"path": "*"}, "cache": {"ttl_s": 60}}
    gw = await pipeline(policy({"main": {"url": URL}}, route), echo)
    draw = random.Random(26)
    bodies = [b'{"inputs":[1,2,3]}', b'{"inputs":[1,2,4]}', b'{"inputs":[1,2,3]} ', b"\x00\x01"]
    framings = [[], [("Content-Encoding", "gzip")], [("Content-Encoding", "deflate")]]
    tenants = [[], ALICE, BOB, [("Authorization", "bearer sk-alice ")]]  # Alice's, written so
    asked: dict[tuple[int, int, int], str] = {}  # each triple's first answer
    for _ in range(300):
        b, f, t = draw.randrange(len(bodies)), draw.randrange(len(framings)), draw.randrange(4)
        answer = await gw.request("POST", INFER, body=bodies[b], headers=framings[f] + tenants[t])
        assert answer.status_code == 200
        scope = 1 if t == 3 else t  # the scheme's case and the spaces are not a tenant
        state = "hit" if (b, f, scope) in asked else "miss"
        assert answer.headers["X-Gateway-Cache"] == state
        sent = tenants[t][0][1] if tenants[t] else ""
        mine = bodies[b] + (framings[f][0][1] if framings[f] else "").encode()
        if state == "miss":
            assert answer.json()["echo"] == hashlib.sha256(mine + sent.encode()).hexdigest()
            asked[(b, f, scope)] = answer.json()["echo"]
        assert answer.json()["echo"] == asked[(b, f, scope)]


@pytest.mark.llm
async def test_llama_cpps_own_greedy_completion_is_answered_from_the_cache(
    llama, start_gateway, tmp_path
):
    """The real server (llama.cpp, Gemma 3 270M): a greedy ``/completion`` asked twice is
    generated once, the second answered from the cache as the server said it; a sampled one
    is generated each time."""
    import httpx

    from tests.helpers import write_policy

    route = {"name": "llm", "match": {"path": "*"}, "backend": "llm", "cache": {"ttl_s": 60}}
    doc = {"backends": {"llm": {"url": llama.url}}, "routes": [route]}
    gw = await start_gateway(policy=write_policy(tmp_path, doc))
    greedy = {"prompt": "The capital of France is", "n_predict": 6, "temperature": 0}
    async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
        first = await client.post("/completion", json=greedy)
        again = await client.post("/completion", json=greedy)
        sampled = await client.post("/completion", json={**greedy, "temperature": 0.8})
    assert [r.headers["X-Gateway-Cache"] for r in (first, again, sampled)] == [
        "miss",
        "hit",
        "bypass",
    ]
    assert again.content == first.content and first.json()["tokens_predicted"] == 6


class Echoing(Model):
    """A KServe V2 server echoing each request's ``id``, as MLServer and Triton do."""

    def answer(self, sent: Sent) -> Reply:
        asked = json.loads(sent.body).get("id")
        output = {"name": "y", "shape": [1, 1], "datatype": "FP32", "data": [len(self.bodies)]}
        answer = {"model_name": "recommender", "outputs": [output]}
        return json_reply({"model_name": "recommender", "id": asked, **answer} if asked else answer)


def with_id(rid: str, row: list[float]) -> bytes:
    """As KServe's Python client writes a request: its ``id`` first, a fresh uuid4 if none."""
    return json.dumps({"id": rid, **infer(row)}).encode()


async def test_a_fresh_request_id_per_call_still_hits_and_gets_its_own_id_back(pipeline):
    """KServe's client sends a new uuid4 with every call: keyed with it, nothing would hit."""
    model = Echoing()
    route = {"match": {"path": "*"}, "cache": {"ttl_s": 60}}
    gw = await pipeline(policy({"main": {"url": URL}}, route), model)
    first = await gw.request("POST", INFER, body=with_id("a-1", [1, 2, 3]), headers=ALICE)
    again = await gw.request("POST", INFER, body=with_id("b-22", [1, 2, 3]), headers=ALICE)
    assert again.headers["X-Gateway-Cache"] == "hit" and len(model.bodies) == 1
    assert (first.json()["id"], again.json()["id"]) == ("a-1", "b-22")
    assert again.json()["outputs"] == first.json()["outputs"]
    bare = await gw.request("POST", INFER, body=json.dumps(infer([1, 2, 3])).encode())
    assert bare.headers["X-Gateway-Cache"] == "miss" and "id" not in bare.json()  # keyed apart
    inside = json.dumps({**infer([1, 2, 3]), "id": "c-3"}).encode()  # not first: in the key
    assert (await gw.request("POST", INFER, body=inside)).headers["X-Gateway-Cache"] == "miss"


async def test_an_answer_framed_by_length_is_not_stored_when_its_id_was_left_out(pipeline):
    def binary(sent: Sent) -> Reply:
        framed = [("Inference-Header-Content-Length", "17")]
        return json_reply({"id": "a-1", "outputs": []}, headers=framed)

    route = {"match": {"path": "*"}, "cache": {"ttl_s": 60}}
    gw = await pipeline(policy({"main": {"url": URL}}, route), binary)
    for _ in range(2):
        answer = await gw.request("POST", INFER, body=with_id("a-1", [1, 2, 3]))
        assert answer.headers["X-Gateway-Cache"] == "miss"


async def test_calls_in_flight_with_their_own_ids_share_one_call_each_its_own_id(pipeline):
    """KServe's client sends a fresh id with every call: identical inferences in flight
    share one call all the same, each caller given its own id where the answer echoed the
    first's."""
    model = Echoing()
    route = {"match": {"path": "*"}, "cache": {"ttl_s": 60}}
    gw = await pipeline(policy({"main": {"url": URL}}, route), model)
    model.gate = asyncio.Event()
    calls = [gw.send("POST", INFER, body=with_id(f"r-{i}", [1, 2, 3])) for i in range(3)]
    await until(lambda: len(model.bodies) == 1)
    await until(lambda: joined(gw) == 2)
    model.gate.set()
    answers = [await c.done() for c in calls]
    assert [a.json()["id"] for a in answers] == ["r-0", "r-1", "r-2"]
    assert len(model.bodies) == 1 and len({json.dumps(a.json()["outputs"]) for a in answers}) == 1


async def test_calls_in_flight_of_two_tenants_never_share_one_call_whatever_their_ids(pipeline):
    """The same inference from two tenants at once, with ids or without: each tenant's call
    goes upstream on its own credentials, and each answer to its own caller."""
    model = Echoing()
    route = {"match": {"path": "*"}, "cache": {"ttl_s": 60}}
    gw = await pipeline(policy({"main": {"url": URL}}, route), model)
    model.gate = asyncio.Event()
    asked = [(with_id(f"r-{i}", [1, 2, 3]), who) for i, who in enumerate((ALICE, BOB, BOB))]
    calls = [gw.send("POST", INFER, body=body, headers=who) for body, who in asked]
    await until(lambda: len(model.bodies) == 2)
    await until(lambda: joined(gw) == 1)  # Bob's second joined Bob's first, never Alice's
    model.gate.set()
    assert [(await c.done()).json()["id"] for c in calls] == ["r-0", "r-1", "r-2"]
    sent = sorted(
        dict((k.lower(), v) for k, v in s.headers)["authorization"] for s in gw.transport.sent
    )
    assert sent == ["Bearer sk-alice", "Bearer sk-bob"]


class Framing(Echoing):
    """Echoes each id in an answer framed by length, as for KServe's binary tensors, or
    compressed (``gzip``: as Triton answers a client that accepts it)."""

    def __init__(self, compressed: bool) -> None:
        super().__init__()
        self.compressed = compressed

    def answer(self, sent: Sent) -> Reply:
        reply = super().answer(sent)
        body = reply.body or b""
        if self.compressed:
            zipped = zlib.compressobj(wbits=31)
            body = zipped.compress(body) + zipped.flush()
            return reply.replace(body=body).with_headers((("Content-Encoding", "gzip"),))
        return reply.with_headers((("Inference-Header-Content-Length", str(len(body))),))


@pytest.mark.parametrize("framing", ["asked", "answered", "compressed"])
async def test_calls_for_binary_tensors_in_flight_each_get_their_own_call(pipeline, framing):
    """Asked for binary tensors, or answered framed by length unasked, or compressed: an
    echoed id cannot be rewritten, so calls with other ids never share an answer (the
    joiners of the latter two make their own calls, counted as such)."""
    model = Framing(compressed=framing == "compressed")
    route = {"match": {"path": "*"}, "cache": {"ttl_s": 60}}
    gw = await pipeline(policy({"main": {"url": URL}}, route), model)
    model.gate = asyncio.Event()
    asked = {"parameters": {"binary_data_output": True}} if framing == "asked" else {}
    bodies = [json.dumps({"id": f"r-{i}", **infer([1, 2, 3], **asked)}) for i in range(3)]
    calls = [gw.send("POST", INFER, body=body.encode()) for body in bodies]
    await until(lambda: len(model.bodies) == (3 if framing == "asked" else 1))
    await asyncio.sleep(0.05)
    model.gate.set()
    answers = [await c.done() for c in calls]
    if framing == "compressed":
        answers = [json.loads(zlib.decompress(a.body, wbits=31)) for a in answers]
    else:
        answers = [a.json() for a in answers]
    assert [a["id"] for a in answers] == ["r-0", "r-1", "r-2"]
    assert len(model.bodies) == 3
    own = gw.metric("gateway_coalesced_own_calls_total", route="chat") or 0.0
    assert own == joined(gw) == (0 if framing == "asked" else 2)
