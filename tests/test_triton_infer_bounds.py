"""A route's ``generation`` on Triton's ``infer`` (KServe V2): TensorRT-LLM's ``max_tokens``
input tensor, vLLM's backend's ``sampling_parameters`` text and the request's
``parameters.max_tokens`` are bounded in both framings Triton reads, the bodies built by
Triton's own client library (``tritonclient.http``); any other model's call goes as it came.
Triton reads the first of two members of one name, so such a body is refused on its paths."""

from __future__ import annotations

import gzip
import json
import struct
from typing import Any

import numpy as np
import pytest
import tritonclient.http as triton
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.utils import triton_to_np_dtype

from gateway.openai.generation import BOUND_HEADER
from gateway.pipeline import Reply
from gateway.policy.load import parse_policy_text
from gateway.testing import Sent, json_reply
from tests.helpers import policy

URL = "http://main.test"
INFER = "/v2/models/ensemble/infer"
FRAMED = "Inference-Header-Content-Length"


class Recorder:
    """A Triton answering every call with one small output; ``sent`` holds each call."""

    def __init__(self) -> None:
        self.sent: list[Sent] = []

    async def __call__(self, sent: Sent) -> Reply:
        self.sent.append(sent)
        out = {"name": "text_output", "datatype": "BYTES", "shape": [1], "data": ["ok"]}
        return json_reply({"model_name": "ensemble", "outputs": [out]})

    def tensors(self, index: int = -1) -> tuple[dict[str, Any], dict[str, bytes]]:
        """A call's JSON, and the binary data of each input that has some, by name."""
        sent = self.sent[index]
        length = int(sent.header(FRAMED) or len(sent.body))
        head, blob = json.loads(sent.body[:length]), sent.body[length:]
        data, at = {}, 0
        for one in head["inputs"]:
            size = one.get("parameters", {}).get("binary_data_size")
            if size is not None:
                data[one["name"]] = blob[at : at + size]
                at += size
        assert at == len(blob)
        return head, data


async def gateway(pipeline: Any, **bounds: Any) -> tuple[Any, Recorder]:
    recorder = Recorder()
    route = {
        "name": "triton",
        "match": {"path": "/v2/*"},
        "generation": bounds or {"max_tokens": 100},
    }
    return await pipeline(policy({"main": {"url": URL}}, route), recorder), recorder


def tensor(name: str, value: Any, datatype: str, binary: bool) -> triton.InferInput:
    array = np.array(value, dtype=triton_to_np_dtype(datatype))
    one = triton.InferInput(name, list(array.shape), datatype)
    one.set_data_from_numpy(array, binary_data=binary)
    return one


def trtllm(max_tokens: Any, *, binary: bool, datatype: str = "INT32", **options: Any):
    """TensorRT-LLM's ensemble call, as ``tritonclient`` sends it: the body, its headers."""
    inputs = [
        tensor("text_input", [[b"What is Triton?"]], "BYTES", binary),
        tensor("max_tokens", max_tokens, datatype, binary),
        tensor("bad_words", [[b""]], "BYTES", binary),
    ]
    return request(inputs, **options)


def request(inputs: list[triton.InferInput], **options: Any) -> tuple[bytes, dict[str, str]]:
    body, length = triton.InferenceServerClient.generate_request_body(inputs, **options)
    headers = {"Content-Type": "application/octet-stream"}
    if length is not None:
        headers[FRAMED] = str(length)
    return body, headers


def refused(answer: Any, status: int = 400) -> dict[str, Any]:
    assert answer.status_code == status, answer.body
    return json.loads(answer.body)["error"]


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
async def test_tensorrt_llms_max_tokens_tensor_is_clamped(pipeline, binary):
    gw, backend = await gateway(pipeline)
    body, headers = trtllm([[5000]], binary=binary)
    answer = await gw.request("POST", INFER, body=body, headers=headers)
    assert answer.status_code == 200 and answer.headers[BOUND_HEADER] == "100"
    head, data = backend.tensors()
    if binary:
        assert struct.unpack("<i", data["max_tokens"]) == (100,)
        assert data["text_input"] == struct.pack("<I", 15) + b"What is Triton?"  # untouched
    else:
        assert head["inputs"][1]["data"] == [100]
        assert head["inputs"][0] == json.loads(body)["inputs"][0]
    assert gw.metric("gateway_generation_bounds_total", route="triton", action="clamped") == 1


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
async def test_a_call_within_the_bound_goes_byte_for_byte(pipeline, binary):
    gw, backend = await gateway(pipeline)
    body, headers = trtllm([[100]], binary=binary)
    answer = await gw.request("POST", INFER, body=body, headers=headers)
    assert answer.status_code == 200 and BOUND_HEADER not in answer.headers
    assert backend.sent[0].body == body


@pytest.mark.parametrize("datatype", ["INT64", "UINT32", "INT16"])
async def test_every_integer_datatype_is_read_and_written_as_it_came(pipeline, datatype):
    gw, backend = await gateway(pipeline)
    body, headers = trtllm([[5000], [7]], binary=True, datatype=datatype)
    await gw.request("POST", INFER, body=body, headers=headers)
    head, data = backend.tensors()
    assert head["inputs"][1]["datatype"] == datatype
    assert np.frombuffer(data["max_tokens"], dtype=datatype.lower()).tolist() == [100, 7]


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
async def test_vllms_sampling_parameters_text_is_bounded_and_kept_a_text(pipeline, binary):
    """vLLM's backend for Triton reads its sampling parameters as the JSON text of a BYTES
    tensor: binary, the element's length and the input's ``binary_data_size`` change."""
    gw, backend = await gateway(pipeline)
    text = json.dumps({"max_tokens": 5000, "temperature": 0.5}).encode()
    inputs = [
        tensor("text_input", [b"What is Triton?"], "BYTES", binary),
        tensor("sampling_parameters", [text], "BYTES", binary),
    ]
    body, headers = request(inputs)
    answer = await gw.request("POST", INFER, body=body, headers=headers)
    assert answer.status_code == 200 and answer.headers[BOUND_HEADER] == "100"
    head, data = backend.tensors()
    if binary:
        (size,) = struct.unpack_from("<I", data["sampling_parameters"])
        sent = data["sampling_parameters"][4:]
        assert size == len(sent) and head["inputs"][1]["parameters"]["binary_data_size"] == 4 + size
        assert int(backend.sent[0].header(FRAMED) or 0) == len(
            json.dumps(head, separators=(",", ":"))
        )
    else:
        sent = head["inputs"][1]["data"][0].encode()
    assert json.loads(sent) == {"max_tokens": 100, "temperature": 0.5}


async def test_the_requests_own_max_tokens_parameter_is_bounded(pipeline):
    gw, backend = await gateway(pipeline)
    body, headers = request(
        [tensor("text_input", [b"hi"], "BYTES", True)], parameters={"max_tokens": 5000}
    )
    await gw.request("POST", INFER, body=body, headers=headers)
    head, data = backend.tensors()
    assert head["parameters"]["max_tokens"] == 100 and data["text_input"] == b"\x02\x00\x00\x00hi"


async def test_over_refuse_names_the_field_and_sends_nothing(pipeline):
    gw, backend = await gateway(pipeline, max_tokens=100, over="refuse")
    for binary in (False, True):
        body, headers = trtllm([[5000]], binary=binary)
        error = refused(await gw.request("POST", INFER, body=body, headers=headers))
        assert error["param"] == "max_tokens" and "at most 100" in error["message"]
    assert backend.sent == []
    assert gw.metric("gateway_generation_bounds_total", route="triton", action="refused") == 2


async def test_a_bound_the_gateway_cannot_read_is_refused_never_passed(pipeline):
    gw, backend = await gateway(pipeline)
    cases: list[tuple[bytes, dict[str, str], int]] = []
    for value, datatype in (([[0]], "INT32"), ([[-1]], "INT64"), ([[5000.0]], "FP32")):
        cases += [
            (*trtllm(value, binary=binary, datatype=datatype), 400) for binary in (False, True)
        ]
    shm = {"name": "max_tokens", "datatype": "INT32", "shape": [1],
           "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 4}}  # fmt: skip
    cases.append((json.dumps({"inputs": [shm]}).encode(), {}, 400))
    body, headers = trtllm([[5000]], binary=True)
    cases.append((body, {**headers, FRAMED: str(len(body) + 1)}, 400))  # past the body
    cases.append((body, {**headers, FRAMED: "9" * 5000}, 400))  # past what int() reads
    cases.append((body, {**headers, FRAMED: "\u00b2"}, 400))  # a digit, but not ASCII's
    cases.append((body[:-2], headers, 400))  # its data cut short
    json_body, _ = trtllm([[5000]], binary=False)
    cases.append((gzip.compress(json_body), {"Content-Encoding": "gzip"}, 415))
    cases.append((json_body.replace(b"[5000]", b'["5000"]'), {}, 400))
    for body, headers, status in cases:
        refused(await gw.request("POST", INFER, body=body, headers=headers), status)
    assert backend.sent == []


async def test_an_escaped_name_is_read_as_triton_reads_it(pipeline):
    gw, backend = await gateway(pipeline)
    body, _ = trtllm([[5000]], binary=False)
    escaped = body.replace(b'"max_tokens"', b'"max\\u005ftokens"')
    await gw.request("POST", INFER, body=escaped)
    assert backend.tensors()[0]["inputs"][1]["data"] == [100]


@pytest.mark.parametrize(
    "path, body",
    [
        (INFER, b'{"inputs": [], "parameters": {"max_tokens": 5000, "max_tokens": 10}}'),
        (  # a tensor's data twice: Triton reads the first
            INFER,
            b'{"inputs": [{"name": "max_tokens", "datatype": "INT32", "shape": [1],'
            b' "data": [5000], "data": [10]}]}',
        ),
        (  # vLLM's backend at generate: the request's parameters
            "/v2/models/vllm/generate",
            b'{"text_input": "p", "parameters": {"max_tokens": 5000, "max_tokens": 10}}',
        ),
    ],
    ids=["infer-parameters", "infer-data", "generate-parameters"],
)
async def test_a_member_named_twice_is_refused_on_tritons_paths(pipeline, path, body):
    """RapidJSON finds the first of two members of one name; Python's parser keeps the
    last: the gateway would bound the one Triton never reads."""
    gw, backend = await gateway(pipeline)
    assert "twice" in refused(await gw.request("POST", path, body=body))["message"]
    assert backend.sent == []


async def test_any_other_models_call_goes_as_it_came(pipeline):
    """An image model's call is not read: its JSON names no bounded tensor."""
    gw, backend = await gateway(pipeline)
    pixels = np.arange(3 * 64 * 64, dtype=np.float32).reshape(1, 3, 64, 64)
    for binary in (False, True):
        body, headers = request([tensor("images", pixels, "FP32", binary)])
        answer = await gw.request("POST", INFER, body=body, headers=headers)
        assert answer.status_code == 200 and BOUND_HEADER not in answer.headers
        assert backend.sent[-1].body == body
    squeezed = gzip.compress(body)  # compressed, naming no bound: sent as it came
    await gw.request("POST", INFER, body=squeezed, headers={**headers, "Content-Encoding": "gzip"})
    assert backend.sent[-1].body == squeezed


@pytest.mark.parametrize("path", ["/v2/models/*/infer", "/v2/models/ensemble/versions/1/infer"])
def test_a_route_to_tritons_infer_may_bound_it(path):
    route = {"match": {"path": path}, "backend": "main", "generation": {"max_tokens": 10}}
    text = json.dumps({"backends": {"main": {"url": URL}}, "routes": [route]})
    assert parse_policy_text(text, "p.yaml").routes[0].generation is not None


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(st.integers(1, 2**31 - 1), min_size=1, max_size=6),
    most=st.integers(1, 10_000),
    binary=st.booleans(),
)
async def test_every_value_past_the_bound_is_clamped_and_no_other_changes(values, most, binary):
    from gateway.testing.harness import Pipeline  # hypothesis runs outside the fixture

    route = {"match": {"path": "/v2/*"}, "generation": {"max_tokens": most}}
    recorder = Recorder()
    async with Pipeline(json.dumps(policy({"main": {"url": URL}}, route)), recorder) as gw:
        body, headers = trtllm([values], binary=binary)
        answer = await gw.request("POST", INFER, body=body, headers=headers)
        assert answer.status_code == 200
        head, data = recorder.tensors()
        sent = (
            list(struct.unpack(f"<{len(values)}i", data["max_tokens"]))
            if binary
            else head["inputs"][1]["data"]
        )
        assert sent == [min(value, most) for value in values]
        if max(values) <= most:
            assert recorder.sent[0].body == body


def text_output(size: int) -> dict[str, Any]:
    """TensorRT-LLM's answer through ``infer``: its text, and no count."""
    out = {"name": "text_output", "datatype": "BYTES", "shape": [1], "data": ["y" * size]}
    return {"model_name": "ensemble", "outputs": [out]}


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
async def test_a_token_limit_estimates_infer_at_its_tensors_and_settles_on_its_size(binary):
    """Under a ``tokens_per_min`` limit, a generation through ``infer`` is estimated at its
    ``max_tokens`` tensor (a row of a batch each) and, its answer naming no count, settled at
    a token per 4 bytes of it: before, it was charged its body's size however much it made."""
    from gateway.testing import FakeClock
    from gateway.testing.harness import Pipeline
    from tests.test_native_usage import limited
    from tests.test_rate_headers import ALICE
    from tests.test_rate_limit_streams import LIMIT, left

    async with Pipeline(
        json.dumps(limited()), lambda _: json_reply(text_output(8000)), clock=FakeClock()
    ) as gw:
        body, headers = trtllm([[300], [200]], binary=binary)
        answer = await gw.request("POST", INFER, body=body, headers={**headers, **ALICE})
        assert answer.status_code == 200
        assert left(gw) == LIMIT - len(body) // 4 - len(answer.body) // 4
    async with Pipeline(
        json.dumps(limited()), lambda _: json_reply(text_output(4)), clock=FakeClock()
    ) as gw:
        answer = await gw.request("POST", INFER, body=body, headers={**headers, **ALICE})
        assert left(gw) == LIMIT - len(body) // 4 - 500  # at least the estimate
        pixels = np.zeros((1, 3, 8, 8), dtype=np.float32)  # another model: as before
        image, framing = request([tensor("images", pixels, "FP32", binary)])
        before = left(gw)
        await gw.request("POST", INFER, body=image, headers={**framing, **ALICE})
        assert left(gw) == before - len(image) // 4 - 1


async def test_a_name_across_the_scans_window_is_found(pipeline):
    """A large body is scanned a window at a time (the event loop runs between them): a
    name that straddles two windows is still found, and the call bounded."""
    from gateway.openai.body import YIELD_FROM_BYTES

    gw, backend = await gateway(pipeline)

    def body(pad: int) -> bytes:
        padding = {"name": "pad", "datatype": "BYTES", "shape": [1], "data": ["x" * pad]}
        bound = {"name": "max_tokens", "datatype": "INT32", "shape": [1], "data": [5000]}
        return json.dumps({"inputs": [padding, bound]}).encode()

    pad = YIELD_FROM_BYTES
    pad -= body(pad).index(b"max_tokens") - (YIELD_FROM_BYTES - 5)  # 5 bytes in the first
    raw = body(pad)
    assert raw.index(b"max_tokens") == YIELD_FROM_BYTES - 5
    answer = await gw.request("POST", INFER, body=raw)
    assert answer.headers[BOUND_HEADER] == "100"
    assert backend.tensors()[0]["inputs"][1]["data"] == [100]
