"""A route's ``generation``: how much one call may ask the model to generate.  A call asking
for more output tokens than ``max_tokens`` is sent with ``max_tokens`` (or refused with
``over: refuse``); a call naming no bound is given ``default_max_tokens``; more choices than
``max_choices`` is a 400 naming the field; a bound the gateway cannot read as a positive
integer is a 400, never passed around the cap.  A token limit's estimate is the bound the
call is sent with, times the answers it asks for."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import RequestError
from gateway.openai.body import texts_read, texts_written
from gateway.openai.generation import BOUND_HEADER, bounded, with_bounds
from gateway.pipeline import Reply
from gateway.policy.generation import (
    OUTPUT_FIELDS,
    PROMPT_NEEDED,
    TEXT_MEMBERS,
    Generation,
    is_native,
    output_fields,
    tighter,
)
from gateway.policy.load import parse_policy_text
from gateway.testing import Sent, json_reply
from tests.backends import Model, started
from tests.helpers import chat, policy, problems_of, until

URL = "http://main.test"
CHAT = "/v1/chat/completions"


class Recorder:
    """A backend answering every OpenAI or Anthropic call with a small answer; ``bodies``
    holds each body it was sent."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    async def __call__(self, sent: Sent) -> Reply:
        self.bodies.append(sent.json())
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        return json_reply({"id": "x", "object": "chat.completion", "choices": [], "usage": usage})


async def gateway(pipeline: Any, bounds: dict[str, Any], backend: Any = None, **route: Any):
    recorder = backend if backend is not None else Recorder()
    everything = {"match": {"path": "*"}, "generation": bounds, **route}
    gw = await pipeline(policy({"main": {"url": URL}}, everything), recorder)
    return gw, recorder


def refused(answer: Any) -> dict[str, Any]:
    assert answer.status_code == 400, answer.body
    return json.loads(answer.body)["error"]


async def test_a_call_asking_more_than_the_most_is_sent_with_the_most(pipeline):
    gw, backend = await gateway(pipeline, {"max_tokens": 256})
    answer = await gw.post(CHAT, chat(max_tokens=5000, max_completion_tokens=4000))
    assert answer.status_code == 200
    assert answer.headers[BOUND_HEADER] == "256"
    assert backend.bodies[0]["max_tokens"] == backend.bodies[0]["max_completion_tokens"] == 256
    assert backend.bodies[0]["messages"] == chat()["messages"]  # the rest as sent
    assert gw.metric("gateway_generation_bounds_total", route="chat", action="clamped") == 1


async def test_a_call_within_the_bounds_goes_byte_for_byte(pipeline):
    gw, backend = await gateway(pipeline, {"max_tokens": 256, "max_choices": 2})
    sent = chat(max_tokens=256, n=2)
    answer = await gw.post(CHAT, sent)
    assert answer.status_code == 200 and BOUND_HEADER not in answer.headers
    assert backend.bodies == [sent]
    assert gw.metric("gateway_generation_bounds_total", route="chat", action="clamped") == 0


@pytest.mark.parametrize("named", [{}, {"max_tokens": None}, {"max_completion_tokens": None}])
async def test_a_call_naming_no_bound_is_given_the_default(pipeline, named):
    gw, backend = await gateway(pipeline, {"max_tokens": 256, "default_max_tokens": 64})
    answer = await gw.post(CHAT, chat(**named))
    assert answer.headers[BOUND_HEADER] == "64"
    assert backend.bodies[0]["max_tokens"] == 64
    assert gw.metric("gateway_generation_bounds_total", route="chat", action="defaulted") == 1


async def test_without_a_default_a_call_naming_none_is_given_the_most(pipeline):
    gw, backend = await gateway(pipeline, {"max_tokens": 128})
    await gw.post(CHAT, chat())
    assert backend.bodies[0]["max_tokens"] == 128  # a cap a call escapes by naming none is none


async def test_over_refuse_answers_400_naming_the_field(pipeline):
    gw, backend = await gateway(pipeline, {"max_tokens": 256, "over": "refuse"})
    error = refused(await gw.post(CHAT, chat(max_completion_tokens=257)))
    assert (error["param"], error["code"], error["type"]) == (
        "max_completion_tokens",
        "integer_above_max_value",
        "invalid_request_error",
    )
    assert "at most 256" in error["message"]
    assert backend.bodies == []
    assert gw.metric("gateway_generation_bounds_total", route="chat", action="refused") == 1
    assert (await gw.post(CHAT, chat(max_tokens=256))).status_code == 200


async def test_more_choices_than_allowed_is_refused_never_clamped(pipeline):
    gw, backend = await gateway(pipeline, {"max_choices": 2})
    error = refused(await gw.post(CHAT, chat(n=3)))
    assert (error["param"], error["code"]) == ("n", "integer_above_max_value")
    error = refused(await gw.post("/v1/completions", {"model": "m", "prompt": "p", "best_of": 4}))
    assert error["param"] == "best_of"
    sglang = {"text": "p", "sampling_params": {"n": 3}}  # SGLang's parallel sampling
    assert refused(await gw.post("/generate", sglang))["param"] == "sampling_params.n"
    tgi = {"inputs": "p", "parameters": {"best_of": 3}}  # TGI decodes best_of sequences
    assert refused(await gw.post("/generate_stream", tgi))["param"] == "parameters.best_of"
    assert backend.bodies == []
    assert (await gw.post(CHAT, chat(n=2))).status_code == 200
    assert "max_tokens" not in backend.bodies[0]  # no token bound: nothing written


@pytest.mark.parametrize(
    ("path", "body", "answers"),
    [
        ("/v1/completions", {"model": "m", "prompt": ["a", "b", "c"], "n": 2}, 6),
        ("/v1/completions", {"model": "m", "prompt": [[1, 2], [3]], "best_of": 3}, 6),
        ("/completion", {"prompt": ["a", "b", "c", "d", "e"]}, 5),  # llama.cpp: an answer each
        ("/v1/completions", {"model": "m", "prompt": ["a", "b", "c", "d"]}, 4),
        ("/v1/completions", {"model": "m", "prompt": list(range(100))}, 1),  # one token list
        ("/completion", {"prompt": [1, "a", 2]}, 1),  # llama.cpp: tokens and text, one prompt
        ("/generate", {"text": ["a", "b", "c", "d", "e"]}, 5),  # SGLang's batch
        ("/generate", {"input_ids": [[1], [2], [3]], "sampling_params": {"n": 2}}, 6),
        ("/generate", {"input_ids": [1, 2, 3, 4, 5]}, 1),  # one token list
        ("/generate", {"inputs": "a", "parameters": {"best_of": 4}}, 4),  # TGI's: within
    ],
)
async def test_a_list_of_prompts_asks_for_an_answer_each(pipeline, path, body, answers):
    """``max_choices`` bounds the answers one call asks for: ``n`` (or ``best_of``) for
    each prompt of a completion's list."""
    gw, backend = await gateway(pipeline, {"max_choices": 4})
    answer = await gw.post(path, body)
    if answers <= 4:
        assert answer.status_code == 200
        return
    error = refused(answer)
    field = "prompt" if "prompt" in body else next(f for f in ("text", "input_ids") if f in body)
    assert (error["param"], error["code"]) == (field, "array_above_max_length")
    assert f"{answers} answers" in error["message"]
    assert backend.bodies == []


@pytest.mark.parametrize(
    ("value", "code"),
    [
        ("100000", "invalid_type"),  # pydantic would read it as 100000
        (100000.0, "invalid_type"),
        (True, "invalid_type"),
        ([5], "invalid_type"),
        (-1, "integer_below_min_value"),  # llama.cpp: no bound at all
        (0, "integer_below_min_value"),
    ],
)
async def test_a_bound_that_is_not_a_positive_integer_is_refused(pipeline, value, code):
    gw, backend = await gateway(pipeline, {"max_tokens": 256})
    error = refused(await gw.post(CHAT, chat(max_tokens=value)))
    assert (error["param"], error["code"]) == ("max_tokens", code)
    assert backend.bodies == []


async def test_a_route_without_bounds_passes_what_the_backend_will_judge(pipeline):
    backend = Recorder()
    gw = await pipeline(policy({"main": {"url": URL}}), backend)
    await gw.post(CHAT, chat(max_tokens="100000", n=64))
    assert backend.bodies[0]["max_tokens"] == "100000"


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/completions", {"model": "m", "prompt": "p", "max_tokens": 900}, "max_tokens"),
        (
            "/v1/responses",
            {"model": "m", "input": "hi", "max_output_tokens": 900},
            "max_output_tokens",
        ),
        (
            "/v1/messages",
            {"model": "m", "max_tokens": 900, "messages": [{"role": "user", "content": "hi"}]},
            "max_tokens",
        ),
    ],
)
async def test_each_api_has_its_own_field(pipeline, path, body, field):
    gw, backend = await gateway(pipeline, {"max_tokens": 100})
    assert (await gw.post(path, body)).headers[BOUND_HEADER] == "100"
    assert backend.bodies[0][field] == 100
    del body[field]
    await gw.post(path, body)
    assert backend.bodies[1][field] == 100


@pytest.mark.parametrize(
    ("path", "body", "read"),
    [
        (  # Ollama: -1 generates until the end
            "/api/chat",
            {"model": "m", "messages": [], "options": {"temperature": 0, "num_predict": -1}},
            lambda b: b["options"]["num_predict"],
        ),
        ("/api/generate", {"model": "m", "prompt": "p"}, lambda b: b["options"]["num_predict"]),
        (  # llama.cpp: -2 generates until the context is full
            "/completion",
            {"prompt": "p", "n_predict": -2},
            lambda b: b["n_predict"],
        ),
        (
            "/generate",
            {"inputs": "p", "parameters": {"max_new_tokens": 5000}},
            lambda b: b["parameters"]["max_new_tokens"],
        ),
        (  # SGLang's own /generate: the bound goes where its sampling parameters are
            "/generate",
            {"text": "p", "sampling_params": {"temperature": 0}},
            lambda b: b["sampling_params"]["max_new_tokens"],
        ),
        (  # SGLang's, naming no sampling parameters: its prompt's field names its server
            "/generate",
            {"text": "p"},
            lambda b: b["sampling_params"]["max_new_tokens"],
        ),
        ("/generate", {"inputs": "p"}, lambda b: b["parameters"]["max_new_tokens"]),  # TGI's
        (  # TGI's compatibility route, where its Python clients post
            "/",
            {"inputs": "p", "stream": True, "parameters": {"max_new_tokens": 5000}},
            lambda b: b["parameters"]["max_new_tokens"],
        ),
        ("/", {"inputs": "p"}, lambda b: b["parameters"]["max_new_tokens"]),
        (  # llama.cpp's OpenAI chat and Responses API without /v1
            "/chat/completions",
            {"messages": [], "max_completion_tokens": 5000},
            lambda b: b["max_completion_tokens"],
        ),
        ("/chat/completions", {"messages": []}, lambda b: b["max_tokens"]),
        ("/responses", {"input": "p", "max_output_tokens": 5000}, lambda b: b["max_output_tokens"]),
        (  # SageMaker's route, which vLLM and TGI serve: chat, a completion, TGI's generate
            "/invocations",
            {"messages": [], "max_tokens": 5000},
            lambda b: b["max_tokens"],
        ),
        ("/invocations", {"prompt": "p"}, lambda b: b["max_tokens"]),
        ("/invocations", {"inputs": "p"}, lambda b: b["parameters"]["max_new_tokens"]),
        (  # vLLM's tokens in, tokens out
            "/inference/v1/generate",
            {"model": "m", "token_ids": [1, 2], "sampling_params": {"max_tokens": 5000}},
            lambda b: b["sampling_params"]["max_tokens"],
        ),
        (
            "/inference/v1/generate",
            {"model": "m", "token_ids": [1, 2]},
            lambda b: b["sampling_params"]["max_tokens"],
        ),
        (  # vLLM's demonstration server: SamplingParams' fields at the top; -1 is none
            "/generate",
            {"prompt": "p", "max_tokens": -1},
            lambda b: b["max_tokens"],
        ),
        ("/generate", {"prompt": "p"}, lambda b: b["max_tokens"]),
        ("/infill", {"input_prefix": "def f(", "input_suffix": ")"}, lambda b: b["max_tokens"]),
        (  # Triton's generate extension: TensorRT-LLM's input tensor at the top
            "/v2/models/llama/generate",
            {"text_input": "p", "max_tokens": 5000, "bad_words": "", "stop_words": ""},
            lambda b: b["max_tokens"],
        ),
        (  # its vLLM backend: the request's parameters
            "/v2/models/llama/versions/2/generate_stream",
            {"text_input": "p", "parameters": {"stream": True, "temperature": 0}},
            lambda b: b["parameters"]["max_tokens"],
        ),
        ("/v2/models/llama/generate", {"text_input": "p"}, lambda b: b["parameters"]["max_tokens"]),
        (  # a tensor given as a list of one, as Triton's generate reads it too
            "/v2/models/llama/generate",
            {"text_input": "p", "max_tokens": [5000]},
            lambda b: b["max_tokens"],
        ),
        (  # or the JSON text of its sampling parameters, read in their place
            "/v2/models/llama/generate",
            {"text_input": "p", "sampling_parameters": '{"max_tokens": 5000, "temperature": 0}'},
            lambda b: json.loads(b["sampling_parameters"])["max_tokens"],
        ),
    ],
    ids=[
        "ollama-chat",
        "ollama-generate",
        "llama.cpp",
        "tgi",
        "sglang",
        "sglang-by-text",
        "tgi-by-inputs",
        "tgi-root",
        "tgi-root-default",
        "llama.cpp-chat-without-v1",
        "llama.cpp-chat-without-v1-default",
        "llama.cpp-responses-without-v1",
        "invocations-chat",
        "invocations-completion-default",
        "invocations-tgi-default",
        "vllm-tokens",
        "vllm-tokens-default",
        "vllm",
        "vllm-by-prompt",
        "llama.cpp-infill",
        "triton-tensorrt-llm",
        "triton-vllm",
        "triton-default",
        "triton-list-of-one",
        "triton-vllm-text",
    ],
)
async def test_the_servers_own_apis_are_bounded_alike(pipeline, path, body, read):
    gw, backend = await gateway(pipeline, {"max_tokens": 100})
    answer = await gw.post(path, body)
    assert answer.headers[BOUND_HEADER] == "100"
    assert read(backend.bodies[0]) == 100
    assert len(set(backend.bodies[0]) - set(body)) <= 1  # no other server's field written
    if "options" in body:  # the object's other members kept
        assert backend.bodies[0]["options"].get("temperature") == body["options"].get("temperature")


async def test_another_servers_body_at_the_root_is_sent_as_it_came(pipeline):
    """``/`` is TGI's compatibility route, and any server's root: a body that does not name
    TGI's ``inputs`` is neither bounded nor given TGI's default."""
    gw, backend = await gateway(pipeline, {"max_tokens": 100})
    body = {"prompt": "p", "max_tokens": 5000}
    answer = await gw.post("/", body)
    assert answer.status_code == 200 and BOUND_HEADER not in answer.headers
    assert backend.bodies[0] == body
    embed = {"inputs": ["a", "b"], "normalize": True}  # TEI's: texts to embed, not TGI's
    assert BOUND_HEADER not in (await gw.post("/", embed)).headers
    assert backend.bodies[1] == embed
    vectors = {"model": "m", "input": ["a"]}  # an embedding at SageMaker's route
    assert BOUND_HEADER not in (await gw.post("/invocations", vectors)).headers
    assert backend.bodies[2] == vectors
    # a body it cannot read is refused there, as at /generate: TGI reads some the gateway
    # cannot (a second spelling of a field), and those would pass unbounded
    twice = b'{"inputs": "p", "INPUTS": "q", "parameters": {"max_new_tokens": 5000}}'
    refused = await gw.request("POST", "/", body=twice)
    assert refused.status_code == 400 and len(backend.bodies) == 3


async def test_sglangs_parameters_for_each_prompt_are_each_bounded(pipeline):
    """SGLang's batch may list ``sampling_params``, one object for each prompt: each is
    clamped or given the default, so no prompt of the batch goes unbounded (before, such a
    body was a 400 under a bound)."""
    gw, backend = await gateway(pipeline, {"max_tokens": 100, "default_max_tokens": 50})
    listed = [
        {"max_new_tokens": 5000, "temperature": 0},
        {"temperature": 0.5},
        {"max_new_tokens": 7},
    ]
    body = {"text": ["a", "b", "c"], "sampling_params": listed}
    answer = await gw.post("/generate", body)
    assert answer.status_code == 200 and answer.headers[BOUND_HEADER] == "100"
    sent = backend.bodies[0]
    assert sent["text"] == body["text"]
    assert sent["sampling_params"] == [
        {"max_new_tokens": 100, "temperature": 0},
        {"temperature": 0.5, "max_new_tokens": 50},
        {"max_new_tokens": 7},
    ]
    within = {"text": ["a"], "sampling_params": [{"max_new_tokens": 7}]}
    assert BOUND_HEADER not in (await gw.post("/generate", within)).headers
    assert backend.bodies[1] == within  # as sent
    bad = {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 7}, "greedy"]}
    assert refused(await gw.post("/generate", bad))["param"] == "sampling_params"
    for short in ([], [{"max_new_tokens": 7}]):  # not one for each prompt: unbounded ones
        fewer = {"text": ["a", "b"], "sampling_params": short}
        assert "for the 2 prompts" in refused(await gw.post("/generate", fewer))["message"]
    assert len(backend.bodies) == 2


async def test_a_large_batch_is_bounded_prompt_by_prompt(pipeline):
    """Each prompt's parameters are bounded as one prompt's call: the batch's prompts are
    read once, not once a prompt (50,000 of them took minutes, quadratic, before review)."""
    gw, backend = await gateway(pipeline, {"max_tokens": 100, "max_choices": 5000})
    body = {"text": ["q"] * 5000, "sampling_params": [{"max_new_tokens": 5000}] * 5000}
    assert (await gw.post("/generate", body)).headers[BOUND_HEADER] == "100"
    sent = backend.bodies[0]
    assert sent["sampling_params"] == [{"max_new_tokens": 100}] * 5000
    assert sent["text"] == body["text"]
    more = {"text": ["q"] * 5000, "sampling_params": [{"n": 2}] * 5000}
    error = refused(await gw.post("/generate", more))
    assert error["param"] == "text" and "10000 answers" in error["message"]


async def test_tgis_vertex_route_bounds_each_call_it_lists(pipeline):
    """TGI's ``/vertex`` answers every call of ``instances`` at once, each a TGI generate or
    a chat request: each is bounded in its own field, given the default where it names
    none, and at most ``max_choices`` of them are asked."""
    gw, backend = await gateway(pipeline, {"max_tokens": 100, "max_choices": 3})
    generate = {"inputs": "p", "parameters": {"max_new_tokens": 5000}}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}
    body = {"instances": [generate, chat, {"inputs": "q"}]}
    answer = await gw.post("/vertex", body)
    assert answer.status_code == 200 and answer.headers[BOUND_HEADER] == "100"
    sent = backend.bodies[0]["instances"]
    assert sent[0]["parameters"]["max_new_tokens"] == 100 and sent[1]["max_tokens"] == 100
    assert sent[2]["parameters"]["max_new_tokens"] == 100  # named none: the default
    within = {"instances": [{"inputs": "p", "parameters": {"max_new_tokens": 7}}]}
    await gw.post("/vertex", within)
    assert backend.bodies[1] == within  # as sent
    many = {"instances": [generate] * 4}
    error = refused(await gw.post("/vertex", many))
    assert error["param"] == "instances" and len(backend.bodies) == 2


async def test_tritons_sampling_parameters_text_is_bounded_and_sent_as_text(pipeline):
    """vLLM's backend for Triton reads ``sampling_parameters`` (a JSON text) in place of
    ``parameters``: bounding only the object would bound nothing."""
    gw, backend = await gateway(pipeline, {"max_tokens": 100})
    text = json.dumps({"max_tokens": 5000, "temperature": 0.5, "n": 1})
    body = {"text_input": "p", "parameters": {"max_tokens": 10}, "sampling_parameters": text}
    answer = await gw.post("/v2/models/llama/generate", body)
    assert answer.status_code == 200
    sent = backend.bodies[0]
    assert sent["parameters"] == {"max_tokens": 10}
    assert isinstance(sent["sampling_parameters"], str)
    assert json.loads(sent["sampling_parameters"]) == {
        "max_tokens": 100,
        "temperature": 0.5,
        "n": 1,
    }
    within = {"text_input": "p", "sampling_parameters": '{"max_tokens": 7}'}
    await gw.post("/v2/models/llama/generate", within)
    assert backend.bodies[1] == within  # as sent
    for broken, told in (
        ("{not json", "'sampling_parameters' is not the JSON text of an object"),
        ("[1]", "'sampling_parameters' is not the JSON text of an object"),
        ('{"max_tokens": 1, "MAX_TOKENS": 9}', "twice"),
    ):
        bad = {"text_input": "p", "sampling_parameters": broken}
        assert told in refused(await gw.post("/v2/models/llama/generate", bad))["message"]
    assert len(backend.bodies) == 2


@pytest.mark.parametrize(
    "path", ["/v2/models/llama/generate", "/v2/models/*/generate_stream", "/v2/*"]
)
def test_a_route_to_tritons_generate_may_bound_it(path):
    route = {"match": {"path": path}, "backend": "main", "generation": {"max_tokens": 10}}
    text = json.dumps({"backends": {"main": {"url": URL}}, "routes": [route]})
    assert parse_policy_text(text, "p.yaml").routes[0].generation is not None


async def test_tritons_other_paths_are_not_generations(pipeline):
    gw, backend = await gateway(pipeline, {"max_tokens": 100})
    body = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]}
    await gw.post("/v2/models/llama/infer", body)
    await gw.post("/v2/models/llama/generate/extra", {"max_tokens": 5000})
    assert backend.bodies == [body, {"max_tokens": 5000}]


async def test_a_servers_own_api_asking_for_no_bound_is_refused_with_over_refuse(pipeline):
    gw, backend = await gateway(pipeline, {"max_tokens": 100, "over": "refuse"})
    error = refused(await gw.post("/api/chat", {"model": "m", "options": {"num_predict": -1}}))
    assert error["param"] == "options.num_predict" and "no bound" in error["message"]
    assert backend.bodies == []


async def test_a_servers_own_api_body_must_be_readable_under_bounds(pipeline):
    gw, backend = await gateway(pipeline, {"max_tokens": 100})
    assert (await gw.request("POST", "/api/chat", body=b"{not json")).status_code == 400
    # Ollama's Go server would read the second spelling: unbounded
    twice = {"options": {"num_predict": 10}, "OPTIONS": {"num_predict": -1}}
    assert "twice" in refused(await gw.post("/api/generate", twice))["message"]
    assert refused(await gw.post("/api/chat", {"options": 5}))["param"] == "options"
    gzipped = await gw.request(
        "POST", "/api/chat", body=b"\x1f\x8b", headers=[("Content-Encoding", "gzip")]
    )
    assert gzipped.status_code == 415
    assert backend.bodies == []
    assert gw.metric("gateway_generation_bounds_total", route="chat", action="refused") == 4


async def test_a_servers_own_api_without_bounds_is_not_read(pipeline):
    backend = Recorder()
    gw = await pipeline(policy({"main": {"url": URL}}, {"match": {"path": "*"}}), backend)
    answer = await gw.request("POST", "/api/chat", body=b"[1, 2]")
    assert answer.status_code == 200 and backend.bodies == [[1, 2]]


async def test_anthropics_api_is_refused_in_its_own_shape(pipeline):
    gw, backend = await gateway(pipeline, {"max_tokens": 100, "over": "refuse"})
    body = {"model": "m", "max_tokens": 900, "messages": [{"role": "user", "content": "hi"}]}
    answer = await gw.post("/v1/messages", body)
    assert answer.status_code == 400
    data = json.loads(answer.body)
    assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error"
    assert backend.bodies == []


def tenants_of(**generation: Any) -> dict[str, Any]:
    """``tenants:`` with one named tenant, ``free``, holding ``FREE_KEY`` and ``generation``."""
    digest = hashlib.sha256(FREE_KEY.encode()).hexdigest()
    return {"keys": [{"name": "free", "sha256": digest, "generation": generation}]}


FREE_KEY = "free-tier-key"
FREE = [("Authorization", f"Bearer {FREE_KEY}")]


async def test_a_named_tenants_bounds_hold_on_every_route_the_tighter_with_a_routes(pipeline):
    backend = Recorder()
    backends = {"main": {"url": URL}}
    doc = {
        "backends": backends,
        "routes": [
            {"name": "bounded", "match": {"path": "/v1/chat/*"}, "backend": "main",
             "generation": {"max_tokens": 256, "default_max_tokens": 200}},
            {"name": "open", "match": {"path": "*"}, "backend": "main"},
        ],
        "tenants": tenants_of(max_tokens=100, max_choices=1, over="refuse"),
    }  # fmt: skip
    gw = await pipeline(doc, backend)
    await gw.post(CHAT, chat())  # anyone else: the route's default
    await gw.post(CHAT, chat(), headers=FREE)  # the tenant's most is lower
    await gw.post("/v1/completions", {"model": "m", "prompt": "p"}, headers=FREE)  # open route
    assert [b.get("max_tokens") for b in backend.bodies] == [200, 100, 100]
    error = refused(await gw.post(CHAT, chat(max_tokens=150), headers=FREE))  # refuse wins
    assert error["param"] == "max_tokens"
    assert refused(await gw.post(CHAT, chat(n=2), headers=FREE))["param"] == "n"
    assert (await gw.post(CHAT, chat(max_tokens=150, n=2))).status_code == 200  # not free
    assert gw.metric("gateway_generation_bounds_total", route="open", action="defaulted") == 1


def test_tighter_takes_the_lower_of_each_bound():
    route = Generation(max_tokens=256, default_max_tokens=200)
    tenant = Generation(max_tokens=100, max_choices=1, over="refuse")
    assert tighter(route, tenant) == Generation(
        max_tokens=100, default_max_tokens=100, max_choices=1, over="refuse"
    )
    assert tighter(route, None) is route and tighter(None, None) is None


def test_a_tenants_bounds_are_checked():
    doc = policy({"main": {"url": URL}}, tenants=tenants_of(max_tokens=0))
    assert any(
        "tenants.keys[0].generation.max_tokens: must be at least 1" in p
        for p in problems_of(json.dumps(doc))
    ), problems_of(json.dumps(doc))


async def test_embeddings_are_not_generations(pipeline):
    gw, backend = await gateway(pipeline, {"max_tokens": 100})
    await gw.post("/v1/embeddings", {"model": "m", "input": "hi"})
    assert "max_tokens" not in backend.bodies[0]


async def test_a_clamped_call_shares_the_cache_with_one_asking_the_most(pipeline):
    gw, backend = await gateway(pipeline, {"max_tokens": 64}, cache={"ttl_s": 60})
    assert (await gw.post(CHAT, chat(max_tokens=64, temperature=0))).status_code == 200
    again = await gw.post(CHAT, chat(max_tokens=9999, temperature=0))
    assert again.headers.get("X-Gateway-Cache") == "hit"
    assert len(backend.bodies) == 1


async def test_a_token_limit_counts_every_answer_a_call_asks_for(pipeline):
    """Held calls: the second is admitted or not on the first's estimate alone.  One answer
    of 40 tokens leaves room in a bucket of 100; three answers of 40 (``n: 3``) do not."""
    for n, second in ((1, 200), (3, 429)):
        assert await second_while_first_held(pipeline, n) == second, n


async def second_while_first_held(pipeline: Any, n: int) -> int:
    """The status of a small call while one asking for ``n`` answers of 40 tokens is held."""
    model = Model("main")
    model.hold()
    route = {"rate_limit": {"tokens_per_min": 100}}
    gw = await pipeline(policy({"main": {"url": URL}}, route), model)
    first = started(gw, "a", max_tokens=40, n=n)
    await until(lambda: model.waiting == 1)
    second = started(gw, "b", max_tokens=1)
    await until(lambda: second.done() or model.waiting == 2)  # refused, or admitted and held
    model.let(2)
    assert (await first).status_code == 200
    return (await second).status_code


@pytest.mark.parametrize(
    ("generation", "path", "problem"),
    [
        ({"max_tokens": 0}, "/v1/*", "generation.max_tokens: must be at least 1"),
        ({"max_choices": -1}, "/v1/*", "generation.max_choices: must be at least 1"),
        (
            {"max_tokens": 10, "default_max_tokens": 20},
            "/v1/*",
            "generation.default_max_tokens: must be at most max_tokens (10)",
        ),
        ({"over": "refuse"}, "/v1/*", "generation: bounds nothing"),
        ({"max_tokens": 10}, "/v1/embeddings", "generation: only applies to a route a generation"),
        ({"max_tokens": 10}, "/v2/models/*/ready", "generation: only applies to a route a gen"),
    ],
)
def test_the_policy_refuses_bounds_that_cannot_hold(generation, path, problem):
    text = json.dumps(
        {
            "backends": {"main": {"url": URL}},
            "routes": [{"match": {"path": path}, "backend": "main", "generation": generation}],
        }
    )
    assert any(problem in p for p in problems_of(text)), problems_of(text)


@pytest.mark.llm
async def test_llama_cpps_own_api_is_bounded_too(llama, start_gateway, tmp_path):
    """``/completion`` with ``n_predict: -1`` (until the end), or naming no bound, stops at
    the route's most."""
    import httpx

    from tests.helpers import write_policy

    route = {"backend": "llm", "generation": {"max_tokens": 4}}
    path = write_policy(tmp_path, {"backends": {"llm": {"url": llama.url}}, "routes": [route]})
    gw = await start_gateway(policy=path)
    body = {"prompt": "Once upon a time", "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(timeout=120) as http:
        for named in ({"n_predict": -1}, {}):  # until the end; none (given max_tokens)
            answer = await http.post(gw.url + "/completion", json={**body, **named})
            assert answer.status_code == 200, answer.text
            assert answer.headers[BOUND_HEADER] == "4"
            assert answer.json()["tokens_predicted"] == 4


@pytest.mark.llm
async def test_llama_cpp_generates_no_more_than_the_bound_it_was_sent(
    llama, start_gateway, tmp_path
):
    """The real server (llama.cpp, Gemma 3 270M) reads the bound the gateway writes: a call
    naming none stops at the default, one asking more stops at the most, both at
    ``finish_reason: length``; the openai SDK as the client."""
    import openai
    from openai.types.chat import ChatCompletionUserMessageParam

    from gateway.testing.llama import MODEL_ALIAS
    from tests.helpers import write_policy

    route = {"backend": "llm", "generation": {"max_tokens": 5, "default_max_tokens": 3}}
    path = write_policy(tmp_path, {"backends": {"llm": {"url": llama.url}}, "routes": [route]})
    gw = await start_gateway(policy=path)
    told = ChatCompletionUserMessageParam(role="user", content="Tell me a long story.")
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as c:
        for asked, bound in ((None, 3), (40, 5)):
            raw = await c.chat.completions.with_raw_response.create(
                model=MODEL_ALIAS,
                messages=[told],
                max_tokens=asked if asked is not None else openai.omit,
                temperature=0,
                extra_body={"ignore_eos": True, "cache_prompt": False},
            )
            answer = raw.parse()
            assert raw.headers[BOUND_HEADER] == str(bound)
            assert answer.usage is not None and answer.usage.completion_tokens == bound
            assert answer.choices[0].finish_reason == "length"


VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**20), max_value=10**20),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.sampled_from(["num_predict", "max_new_tokens", "x"]), st.integers()),
    st.dictionaries(st.sampled_from(["max_tokens", "x"]), st.integers()).map(json.dumps),
)


@settings(max_examples=400, deadline=None, database=None)
@given(
    path=st.sampled_from([*sorted(OUTPUT_FIELDS), "/v2/models/m/generate"]),
    values=st.dictionaries(
        st.sampled_from(
            [
                "max_tokens",
                "max_completion_tokens",
                "max_output_tokens",
                "n_predict",
                "n",
                "best_of",
                "options",
                "parameters",
                "sampling_parameters",
            ]
        ),
        VALUES,
    ),
    most=st.integers(min_value=1, max_value=4096),
    over=st.sampled_from(["clamp", "refuse"]),
)
def test_whatever_a_body_holds_it_is_refused_or_sent_within_the_bound(path, values, most, over):
    """A 400 (never another error), or a body whose every bound is an integer from 1 to the
    most: no value, type or nesting gets a call past ``max_tokens``."""
    bounds = Generation(max_tokens=most, max_choices=2, over=over)
    if (needed := PROMPT_NEEDED.get(path)) is not None:  # a shared route: name a prompt
        values = {needed[0]: "p", **values}
    try:
        values, texts = (
            texts_read(values, TEXT_MEMBERS, 10_000) if is_native(path) else (values, ())
        )
        changes, _ = bounded(values, path, bounds)
    except RequestError as exc:
        assert exc.status == 400
        return
    sent = with_bounds(values, changes)
    assert json.loads(json.dumps(texts_written(sent, texts))) is not None
    found = []
    for name in output_fields(path) or ():
        outer, _, inner = name.rpartition(".")
        holder = sent.get(outer) if outer else sent
        found.append(holder.get(inner) if isinstance(holder, dict) else None)
    assert any(value is not None for value in found), sent  # named, or given the default
    for value in found:
        if value is not None:
            assert isinstance(value, int) and not isinstance(value, bool), sent
            assert 1 <= value <= most, sent
