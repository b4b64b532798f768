"""The servers' own APIs are counted in their own words (``gateway/openai/native_usage.py``):
a token limit or a spend budget estimates a call to llama.cpp's ``/completion``, Ollama's,
TGI's or SGLang's at the bound its body names and settles it on the counts its answer
names, so a tenant cannot generate past its ``tokens_per_min`` by leaving OpenAI's API;
``gateway_tokens_total`` counts them too."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.openai.native_usage import MAX_ANSWERS, NativeStreamUsage, from_native_body
from gateway.openai.usage import MAX_LINE_BYTES
from gateway.pipeline import Reply
from gateway.testing import FakeClock, Sent, json_reply, stream_reply
from tests.backends import started
from tests.helpers import policy, until
from tests.test_rate_headers import ALICE, URL
from tests.test_rate_limit_streams import LIMIT, left


def llama_event(content: str, predicted: int, *, stop: bool = False, **more: Any) -> bytes:
    """One of llama.cpp's ``/completion`` stream events, as its server writes them."""
    event = {"index": 0, "content": content, "tokens": [], "stop": stop, "id_slot": -1}
    event |= {"tokens_predicted": predicted, "tokens_evaluated": 2, **more}
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


LLAMA_STREAM = b"".join(
    [
        llama_event(" and", 1),
        llama_event(" welcome", 2),
        llama_event(" to", 3),
        llama_event("", 3, stop=True, prompt="<bos>Hello", timings={"predicted_n": 3}),
    ]
)
OLLAMA_STREAM = b"".join(
    json.dumps(line).encode() + b"\n"
    for line in [
        {"model": "gemma3", "response": "The", "done": False},
        {"model": "gemma3", "response": " sky", "done": False},
        {"model": "gemma3", "response": "", "done": True, "prompt_eval_count": 26, "eval_count": 2},
    ]
)
TGI_STREAM = b"".join(
    b"data:" + json.dumps(event).encode() + b"\n\n"
    for event in [
        {"index": 1, "token": {"id": 5, "text": "a"}, "generated_text": None, "details": None},
        {
            "index": 2,
            "token": {"id": 6, "text": "b"},
            "generated_text": "ab",
            "details": {"finish_reason": "length", "generated_tokens": 2, "seed": None},
        },
    ]
)
SGLANG_STREAM = b"".join(
    [
        b'data: {"text":"a","meta_info":{"prompt_tokens":7,"completion_tokens":1}}\n\n',
        b'data: {"text":"ab","meta_info":{"prompt_tokens":7,"completion_tokens":2}}\n\n',
        b"data: [DONE]\n\n",
    ]
)
SGLANG_BATCH_STREAM = b"".join(  # two prompts' answers interleaved, each by its "index"
    [
        b'data: {"index":0,"text":"a","meta_info":{"prompt_tokens":7,"completion_tokens":1}}\n\n',
        b'data: {"index":1,"text":"x","meta_info":{"prompt_tokens":5,"completion_tokens":1}}\n\n',
        b'data: {"index":1,"text":"xy","meta_info":{"prompt_tokens":5,"completion_tokens":2}}\n\n',
        b'data: {"index":0,"text":"ab","meta_info":{"prompt_tokens":7,"completion_tokens":2}}\n\n',
        b'data: {"index":1,"text":"xyz","meta_info":{"prompt_tokens":5,"completion_tokens":3}}\n\n',
        b"data: [DONE]\n\n",
    ]
)
TRITON_STREAM = b"".join(  # Triton's vLLM backend, asked return_num_*_tokens: each its own
    [
        b'data: {"model_name":"m","model_version":"1","text_output":"a","num_input_tokens":[7],'
        b'"num_output_tokens":[2]}\n\n',
        b'data: {"model_name":"m","model_version":"1","text_output":"bc","num_input_tokens":7,'
        b'"num_output_tokens":3}\n\n',
    ]
)


@pytest.mark.parametrize(
    ("answer", "counts"),
    [
        ({"content": " and welcome", "tokens_predicted": 5, "tokens_evaluated": 2}, (2, 5)),
        (  # several prompts: an answer each
            [
                {"content": "a", "tokens_predicted": 3, "tokens_evaluated": 2},
                {"content": "b", "tokens_predicted": 4, "tokens_evaluated": 6},
            ],
            (8, 7),
        ),
        ({"response": "x", "done": True, "prompt_eval_count": 26, "eval_count": 290}, (26, 290)),
        ({"generated_text": "x", "details": {"generated_tokens": 20}}, (11, 20)),  # TGI: no prompt
        ({"text": "x", "meta_info": {"prompt_tokens": 7, "completion_tokens": 16}}, (7, 16)),
        ({"generated_text": "x"}, None),  # TGI, its details not asked
        (  # Triton's generate, its vLLM backend asked for its counts (tensors of one)
            {"text_output": "x", "num_input_tokens": [7], "num_output_tokens": [16]},
            (7, 16),
        ),
        ({"text_output": "x", "num_input_tokens": 7, "num_output_tokens": 16}, (7, 16)),
        ({"model_name": "m", "model_version": "1", "text_output": "x"}, None),  # TensorRT-LLM
    ],
)
def test_each_servers_whole_answer_is_read_in_its_own_words(answer, counts):
    assert from_native_body(json.dumps(answer).encode(), prompt=11) == counts


@pytest.mark.parametrize(
    ("path", "answer"),
    [
        (
            "/v1/chat/completions",
            b'{"choices":[],"usage":{"prompt_tokens":%s,"completion_tokens":1}}',
        ),
        ("/completion", b'{"content":"x","tokens_predicted":%s,"tokens_evaluated":1}'),
    ],
)
async def test_a_count_past_nine_digits_is_no_count_and_the_answer_goes_through(
    pipeline, path, answer
):
    """A backend's count of 5,000 digits (past what ``int()`` reads) raised through the
    handler: the gateway's own 500.  It is no count now; the answer is relayed as it came."""
    body = answer % (b"9" * 5000)
    gw = await pipeline(limited(), lambda _: json_reply({}).replace(body=body), clock=FakeClock())
    sent = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt": "p"}
    got = await gw.post(path, sent, headers=ALICE)
    assert got.status_code == 200 and got.body == body


def test_a_count_the_model_writes_into_its_answer_is_text_not_a_count():
    written = 'I used "tokens_predicted": 1 and "eval_count": 1, "generated_tokens": 1'
    body = json.dumps({"content": written, "tokens_predicted": 900, "tokens_evaluated": 4})
    assert from_native_body(body.encode()) == (4, 900)
    assert from_native_body(json.dumps({"content": written}).encode()) is None


@pytest.mark.parametrize(
    ("stream", "counts", "events"),
    [
        (LLAMA_STREAM, (2, 3), 4),
        (OLLAMA_STREAM, (26, 2), 3),
        (TGI_STREAM, (0, 2), 2),  # no prompt count
        (SGLANG_STREAM, (7, 2), 2),  # [DONE] is no event
        (SGLANG_BATCH_STREAM, (12, 5), 5),  # each answer's last counts, added up
        (TRITON_STREAM, (7, 5), 2),  # each event's tokens added up
    ],
)
@settings(max_examples=60, deadline=None, database=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=12))
def test_a_stream_is_read_however_it_is_cut_into_chunks(stream, counts, events, cuts):
    usage = NativeStreamUsage()
    at = 0
    for cut in [*sorted({c % (len(stream) + 1) for c in cuts}), len(stream)]:
        usage.feed(stream[at:cut])
        at = cut
    assert (usage.counts, usage.events) == (counts, events)
    assert usage.prompt_named == (stream is not TGI_STREAM)


def test_a_stream_of_more_answers_than_it_counts_apart_stays_bounded():
    """A backend naming ever new ``"index"`` values: the first ``MAX_ANSWERS`` are counted
    apart, the events of any more as one answer, so the watcher's memory stays bounded."""
    usage = NativeStreamUsage()
    for i in range(MAX_ANSWERS + 500):
        usage.feed(b'data: {"index":%d,"meta_info":{"completion_tokens":1}}\n\n' % i)
    assert usage.counts == (0, MAX_ANSWERS + 1) and usage.events == MAX_ANSWERS + 500


def test_a_last_event_longer_than_a_line_is_read_at_its_start_and_its_end():
    """llama.cpp's last event repeats the prompt after its counts: a long prompt makes it
    longer than the line the watcher keeps, and its counts are still read."""
    prompt = "word " * MAX_LINE_BYTES
    stream = llama_event("a", 1) + llama_event("", 9, stop=True, prompt=prompt)
    usage = NativeStreamUsage()
    for at in range(0, len(stream), 4096):
        usage.feed(stream[at : at + 4096])
    assert (usage.counts, usage.events) == ((2, 9), 2)


def llama_answer(sent: Sent) -> Reply:
    """llama.cpp's ``/completion``: ``tokens_predicted`` as asked (``n_predict``)."""
    asked = sent.json().get("n_predict", 16)
    if sent.json().get("stream"):
        return stream_reply([llama_event("x", i + 1) for i in range(asked)])
    return json_reply({"content": "x" * asked, "tokens_predicted": asked, "tokens_evaluated": 9})


def limit(tokens: int) -> dict[str, Any]:
    return {"rate_limit": {"tokens_per_min": tokens}}


def limited() -> dict[str, Any]:
    return policy({"main": {"url": URL}}, {"match": {"path": "*"}, **limit(LIMIT)})


async def test_a_token_limit_settles_llama_cpps_own_api_on_its_counts(pipeline):
    gw = await pipeline(limited(), llama_answer, clock=FakeClock())
    answer = await gw.post("/completion", {"prompt": "Hello", "n_predict": 300}, headers=ALICE)
    assert answer.status_code == 200
    assert left(gw) == LIMIT - 309  # 9 evaluated, 300 predicted, as it said
    assert gw.metric("gateway_tokens_total", backend="main", kind="completion") == 300
    stream = {"prompt": "Hello", "n_predict": 40, "stream": True}
    answer = await gw.post("/completion", stream, headers=ALICE)
    assert answer.status_code == 200
    await until(lambda: left(gw) == LIMIT - 309 - 42)  # its last event: 2 evaluated, 40
    assert gw.metric("gateway_tokens_total", backend="main", kind="completion") == 340


async def test_ollamas_lines_of_json_settle_a_token_limit(pipeline):
    def ollama(sent: Sent) -> Reply:
        return stream_reply([OLLAMA_STREAM], content_type="application/x-ndjson")

    gw = await pipeline(limited(), ollama, clock=FakeClock())
    answer = await gw.post("/api/generate", {"model": "gemma3", "prompt": "Why?"}, headers=ALICE)
    assert answer.body == OLLAMA_STREAM
    await until(lambda: left(gw) == LIMIT - 28)


@pytest.mark.parametrize("path", ["/generate_stream", "/"])
async def test_tgis_stream_settles_its_prompt_at_the_estimate_and_counts_none(pipeline, path):
    """TGI names no prompt count: the limit keeps the prompt's estimate, and
    ``gateway_tokens_total`` counts no prompt tokens rather than a guess.  Its ``/``, where
    its Python clients post, is counted as its ``/generate_stream``."""
    gw = await pipeline(limited(), lambda _: stream_reply([TGI_STREAM]), clock=FakeClock())
    body: dict[str, Any] = {"inputs": "Why is the sky blue?", "parameters": {"max_new_tokens": 50}}
    if path == "/":
        body["stream"] = True
    answer = await gw.post(path, body, headers=ALICE)
    assert answer.body == TGI_STREAM
    await until(lambda: left(gw) == LIMIT - len(json.dumps(body)) // 4 - 2)
    assert gw.metric("gateway_tokens_total", backend="main", kind="completion") == 2
    assert gw.metric("gateway_tokens_total", backend="main", kind="prompt") == 0


async def test_an_answer_naming_no_count_is_charged_a_token_per_four_bytes(pipeline):
    """TGI's ``/generate`` names its count only when asked for its ``details``."""
    text = "y" * 4000
    gw = await pipeline(
        limited(), lambda _: json_reply({"generated_text": text}), clock=FakeClock()
    )
    answer = await gw.post("/generate", {"inputs": "Why?"}, headers=ALICE)
    assert answer.status_code == 200
    prompt = len(json.dumps({"inputs": "Why?"})) // 4
    assert left(gw) == LIMIT - prompt - len(answer.body) // 4


@pytest.mark.parametrize(
    ("answer", "charged"),
    [
        ([{"generated_text": "y" * 4000}], "size"),  # TGI's / answers a list of one
        ([[0.25] * 2000], "estimate"),  # TEI's / answers vectors: not generated text
    ],
)
async def test_an_answer_at_the_root_is_charged_by_size_only_when_it_is_generated_text(
    pipeline, answer, charged
):
    gw = await pipeline(limited(), lambda _: json_reply(answer), clock=FakeClock())
    body = {"inputs": "Why?"}
    got = await gw.post("/", body, headers=ALICE)
    assert got.status_code == 200
    prompt = len(json.dumps(body)) // 4
    spent = len(got.body) // 4 if charged == "size" else 1  # the estimate: one token
    assert left(gw) == LIMIT - prompt - spent


async def test_sagemakers_route_settles_a_chat_on_its_usage_and_an_embedding_at_its_estimate(
    pipeline,
):
    """``/invocations`` (vLLM's, TGI's): a chat there is counted as on ``/v1``; an embedding
    there (vectors, no generated text) keeps its estimate."""
    chat = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 90}}
    gw = await pipeline(limited(), lambda _: json_reply(chat), clock=FakeClock())
    body = {"messages": [{"role": "user", "content": "Why?"}], "max_tokens": 100}
    assert (await gw.post("/invocations", body, headers=ALICE)).status_code == 200
    assert left(gw) == LIMIT - 97
    vectors = {"data": [{"embedding": [0.25] * 2000}], "usage": {"prompt_tokens": 3}}
    gw = await pipeline(limited(), lambda _: json_reply(vectors), clock=FakeClock())
    body = {"model": "m", "input": ["a"]}
    assert (await gw.post("/invocations", body, headers=ALICE)).status_code == 200
    assert left(gw) == LIMIT - len(json.dumps(body)) // 4 - 1  # its estimate: one token


async def test_tgis_vertex_route_is_estimated_at_every_call_it_lists(pipeline):
    """``/vertex`` answers each of its ``instances``: the estimate holds each one's bound, so
    a tenant cannot ask for many generations at the price of one."""
    gw = await pipeline(
        limited(), lambda _: json_reply({"predictions": ["a", "b"]}), clock=FakeClock()
    )
    body = {
        "instances": [
            {"inputs": "p", "parameters": {"max_new_tokens": 300}},
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200},
        ]
    }
    assert (await gw.post("/vertex", body, headers=ALICE)).status_code == 200
    assert left(gw) == LIMIT - len(json.dumps(body)) // 4 - 500  # its answer names no count
    vectors = {"predictions": [[0.25] * 2000]}  # TEI's /vertex: vectors, not generated text
    gw = await pipeline(limited(), lambda _: json_reply(vectors), clock=FakeClock())
    body = {"instances": [{"inputs": ["a", "b"]}]}
    assert (await gw.post("/vertex", body, headers=ALICE)).status_code == 200
    assert left(gw) == LIMIT - len(json.dumps(body)) // 4 - 1  # its estimate, not its size


async def test_tritons_generate_settles_on_its_counts_or_its_size(pipeline):
    """Its vLLM backend's counts when a call asks for them; otherwise (TensorRT-LLM names
    none) a token per four bytes of the answer, as TGI's without ``details``."""
    gw = await pipeline(limited(), lambda _: stream_reply([TRITON_STREAM]), clock=FakeClock())
    body = {"text_input": "Why?", "return_num_output_tokens": True, "parameters": {"stream": True}}
    answer = await gw.post("/v2/models/m/generate_stream", body, headers=ALICE)
    assert answer.body == TRITON_STREAM
    await until(lambda: left(gw) == LIMIT - 12)
    assert gw.metric("gateway_tokens_total", backend="main", kind="completion") == 5
    text = {"model_name": "m", "model_version": "1", "text_output": "y" * 4000}
    gw = await pipeline(limited(), lambda _: json_reply(text), clock=FakeClock())
    answer = await gw.post("/v2/models/m/generate", {"text_input": "Why?"}, headers=ALICE)
    assert answer.status_code == 200
    prompt = len(json.dumps({"text_input": "Why?"})) // 4
    assert left(gw) == LIMIT - prompt - len(answer.body) // 4


@pytest.mark.parametrize(
    ("path", "asked"),
    [
        ("/completion", {"prompt": "a", "n_predict": 90}),
        ("/completion", {"prompt": ["a", "b", "c"], "n_predict": 30}),  # three answers
        ("/api/generate", {"prompt": "a", "options": {"num_predict": 90}}),
        ("/generate", {"inputs": "a", "parameters": {"max_new_tokens": 90}}),
        ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 90}}),
        (  # SGLang's batch: three prompts, an answer each
            "/generate",
            {"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 30}},
        ),
        (  # its parallel sampling: three answers to one prompt
            "/generate",
            {"input_ids": [[1, 2]], "sampling_params": {"max_new_tokens": 30, "n": 3}},
        ),
        ("/generate", {"inputs": "a", "parameters": {"max_new_tokens": 30, "best_of": 3}}),
        (  # SGLang's batch, its parameters listed one for each prompt
            "/generate",
            {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 45}] * 2},
        ),
        ("/v2/models/m/generate", {"text_input": "a", "max_tokens": 90}),  # TensorRT-LLM
        ("/v2/models/m/generate", {"text_input": "a", "max_tokens": [90]}),  # a list of one
        ("/v2/models/m/generate_stream", {"text_input": "a", "parameters": {"max_tokens": 90}}),
        ("/v2/models/m/generate", {"text_input": "a", "sampling_parameters": '{"max_tokens":90}'}),
        ("/v1/completions", {"model": "m", "prompt": ["a", "b", "c"], "max_tokens": 30}),
    ],
)
async def test_a_servers_own_call_is_estimated_at_the_bound_its_body_names(pipeline, path, asked):
    """Held calls: the second is admitted or not on the first's estimate alone.  90 tokens
    asked of a bucket of 100 leave no room for another of 20."""
    gate, held = asyncio.Event(), []

    async def server(sent: Sent) -> Reply:
        held.append(sent)
        await gate.wait()
        return json_reply({"content": "x", "tokens_predicted": 1, "tokens_evaluated": 1})

    route = {"match": {"path": "*"}, **limit(100)}
    gw = await pipeline(policy({"main": {"url": URL}}, route), server, clock=FakeClock())
    first = gw.send("POST", path, json=asked, headers=ALICE)
    await until(lambda: len(held) == 1)
    second = started(gw, "b", max_tokens=20, headers=ALICE)
    await until(lambda: second.done() or len(held) == 2)
    gate.set()
    assert (await first.done()).status_code == 200
    assert (await second).status_code == 429


@pytest.mark.llm
async def test_llama_cpps_own_answers_settle_a_token_limit_as_they_count(
    llama, start_gateway, tmp_path
):
    """The real server (llama.cpp, Gemma 3 270M): a whole ``/completion`` and a streamed one
    settle the tenant's tokens on the counts they name, and are counted as the backend's."""
    import httpx

    from gateway.resilience.rate_limit import RateLimiter
    from gateway.resilience.rates import RATE_LIMITERS
    from gateway.tenant import credential_key
    from tests.helpers import metric, scrape_when_recorded, write_policy

    route = {"name": "llm", "backend": "llm", **limit(LIMIT)}
    path = write_policy(tmp_path, {"backends": {"llm": {"url": llama.url}}, "routes": [route]})
    gw = await start_gateway(policy=path, clock=FakeClock())
    limiter = gw.gateway.registry.peek(RATE_LIMITERS, "llm")
    key = credential_key(ALICE.items())
    assert isinstance(limiter, RateLimiter) and key is not None

    def remaining() -> float | None:
        standing = limiter.standing(key)
        return standing.tokens.remaining if standing and standing.tokens else None

    body = {"prompt": "Once upon a time", "n_predict": 6, "ignore_eos": True, "temperature": 0}
    used = 0
    async with httpx.AsyncClient(timeout=120, headers=ALICE) as http:
        answer = (await http.post(gw.url + "/completion", json=body)).json()
        used += answer["tokens_evaluated"] + answer["tokens_predicted"]
        assert answer["tokens_predicted"] == 6 and remaining() == LIMIT - used
        async with http.stream("POST", gw.url + "/completion", json={**body, "stream": True}) as s:
            lines = [line async for line in s.aiter_lines() if line.startswith("data:")]
        last = json.loads(lines[-1].removeprefix("data:"))
        used += last["tokens_evaluated"] + last["tokens_predicted"]
    await until(lambda: remaining() == LIMIT - used)
    text = await scrape_when_recorded(gw.admin_url, 2)
    assert metric(text, "gateway_tokens_total", backend="llm", kind="completion") == 12


KEYS_AS_TEXT = st.sampled_from(
    ['"tokens_predicted": 1', '\\"eval_count\\": 2', '"generated_tokens":3}', "\\", '"', ": 4"]
)


@settings(max_examples=300, deadline=None, database=None)
@given(
    texts=st.lists(st.one_of(st.text(max_size=20), KEYS_AS_TEXT), max_size=6),
    prompt=st.integers(min_value=0, max_value=10**6),
    predicted=st.integers(min_value=0, max_value=10**6),
    ascii_only=st.booleans(),
    counts_first=st.booleans(),
)
def test_whatever_the_answer_says_only_its_own_counts_are_read(
    texts, prompt, predicted, ascii_only, counts_first
):
    """The counts are read without a parse: whatever text the model wrote, with quotes,
    backslashes and count names in it, before or after them, only the server's own keys
    count."""
    counts = {"tokens_predicted": predicted, "tokens_evaluated": prompt}
    text = {"content": "".join(texts)}
    answer = {**counts, **text} if counts_first else {**text, **counts}
    body = json.dumps(answer, ensure_ascii=ascii_only).encode()
    assert from_native_body(body) == (prompt, predicted)
    usage = NativeStreamUsage()
    usage.feed(b"data: " + body + b"\n\n")
    assert usage.counts == (prompt, predicted)


def test_one_servers_words_are_read_never_two_added_up():
    """An answer in llama.cpp's words that also carried an OpenAI-style count (a later
    version, a proxy between) is counted once."""
    both = {"tokens_predicted": 7, "tokens_evaluated": 2, "usage": {"completion_tokens": 7}}
    assert from_native_body(json.dumps(both).encode()) == (2, 7)


async def test_a_native_calls_counts_are_on_its_trace(pipeline):
    """The server span of a llama.cpp ``/completion`` says what it used, as an OpenAI
    call's does (``gen_ai.usage.*``)."""
    memory = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")
    exporter = memory.InMemorySpanExporter()
    doc = {
        **policy({"main": {"url": URL}}, {"match": {"path": "*"}}),
        "tracing": {"sample_ratio": 1},
    }
    gw = await pipeline(doc, llama_answer, span_exporter=exporter)
    answer = await gw.post("/completion", {"prompt": "Hello", "n_predict": 12})
    assert answer.status_code == 200
    assert gw.gateway.tracer is not None and gw.gateway.tracer.flush()
    [server] = [s for s in exporter.get_finished_spans() if s.kind.name == "SERVER"]
    assert server.attributes["gen_ai.usage.input_tokens"] == 9
    assert server.attributes["gen_ai.usage.output_tokens"] == 12


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        (b"{not json", {}),
        (b"[1, 2]", {}),
        (b"\x1f\x8b\x08", {"Content-Encoding": "gzip"}),
        (b"", {}),
    ],
)
async def test_a_body_the_gateway_cannot_read_goes_on_at_one_token_and_settles_on_its_answer(
    pipeline, body, headers
):
    """A token limit does not judge a server's own body: the server refuses it or answers,
    and its answer's counts settle the call."""
    gw = await pipeline(limited(), llama_answer_any, clock=FakeClock())
    answer = await gw.request("POST", "/completion", body=body, headers={**ALICE, **headers})
    assert answer.status_code == 200
    assert left(gw) == LIMIT - 16 - 9


def llama_answer_any(sent: Sent) -> Reply:
    """llama.cpp's answer to any body: 9 evaluated, 16 predicted."""
    return json_reply({"content": "x", "tokens_predicted": 16, "tokens_evaluated": 9})


@pytest.mark.llm
@pytest.mark.parametrize(
    ("endpoint", "body", "counts"),
    [
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 500},
            ("prompt_tokens", "completion_tokens"),
        ),
        (
            "/responses",
            {"input": "Tell me a story", "max_output_tokens": 500},
            ("input_tokens", "output_tokens"),
        ),
    ],
)
async def test_llama_cpps_openai_apis_without_v1_are_bounded_and_counted(
    llama, start_gateway, tmp_path, endpoint, body, counts
):
    """llama.cpp answers OpenAI's chat and Responses API without ``/v1`` too
    (``/chat/completions``, ``/responses``): a route's bound and a tenant's token limit hold
    there as with ``/v1``.  Before, a client dropping ``/v1`` asked for what it liked and was
    charged its body's size."""
    import httpx

    from gateway.resilience.rate_limit import RateLimiter
    from gateway.resilience.rates import RATE_LIMITERS
    from gateway.tenant import credential_key
    from tests.helpers import write_policy

    route = {"name": "llm", "backend": "llm", "generation": {"max_tokens": 5}, **limit(LIMIT)}
    path = write_policy(tmp_path, {"backends": {"llm": {"url": llama.url}}, "routes": [route]})
    gw = await start_gateway(policy=path, clock=FakeClock())
    limiter = gw.gateway.registry.peek(RATE_LIMITERS, "llm")
    key = credential_key(ALICE.items())
    assert isinstance(limiter, RateLimiter) and key is not None
    async with httpx.AsyncClient(timeout=120, headers=ALICE) as http:
        answer = await http.post(gw.url + endpoint, json={**body, "temperature": 0})
    assert answer.status_code == 200 and answer.headers["X-Gateway-Max-Tokens"] == "5"
    usage = answer.json()["usage"]
    prompt, completion = (usage[name] for name in counts)
    assert 1 <= completion <= 5
    standing = limiter.standing(key)
    assert standing is not None and standing.tokens is not None
    assert standing.tokens.remaining == LIMIT - prompt - completion
