"""Backends that answer through a ``FakeTransport`` (no sockets), for the stage and
pipeline tests: ``Model``, a small OpenAI-style chat backend a test steers (``post`` and
``started`` send it chat requests through a ``Pipeline``); ``ArrayModel``, a model server
of every batchable API, and ``BatchRig``, a pipeline in front of it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gateway.batching import Batcher
from gateway.batching.stage import BATCHERS
from gateway.errors import UpstreamUnavailable
from gateway.openai.usage import asks_usage
from gateway.pipeline import Reply
from gateway.testing import Sent, json_reply, stream_reply
from gateway.testing.harness import Answer, Pipeline
from tests.helpers import chat, until

SSE = (("Content-Type", "text/event-stream"),)
STREAM_USAGE = {"prompt_tokens": 10, "completion_tokens": 6, "total_tokens": 16}
"""The usage a ``Model`` stream ends with when its client asked for it."""
CHAT_PATH = "/v1/chat/completions"


async def post(gw: Pipeline, tag: str = "hello", **kw: Any) -> Answer:
    """A chat request whose user message is ``tag`` (``headers=`` are sent with it)."""
    headers = kw.pop("headers", ())
    return await gw.post(CHAT_PATH, chat(tag, **kw), headers=headers)


def started(gw: Pipeline, tag: str = "hello", **kw: Any) -> asyncio.Task[Answer]:
    """``post``, answered in a task of its own."""
    return asyncio.ensure_future(post(gw, tag, **kw))


class Model:
    """A small OpenAI-style chat backend a test steers: the status it answers, a gate that
    holds calls until let through, a stream that breaks, the logprobs it reports.
    ``arrivals`` holds each call's last user message, in arrival order; ``active`` the
    calls it is answering now (a stream until its end), ``max_active`` the most at once."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.status = 200
        self.retry_after: str | None = None
        self.gate: asyncio.Semaphore | None = None
        self.arrivals: list[str] = []
        self.active = 0
        self.max_active = 0
        self.break_stream_after: int | None = None
        self.logprob = -0.1
        self.bodies: list[dict[str, Any]] = []
        self.mid_stream: asyncio.Event | None = None
        self.waiting = 0

    def hold(self) -> None:
        """Hold every call until ``let`` lets it through."""
        self.gate = asyncio.Semaphore(0)

    def let(self, n: int = 1) -> None:
        assert self.gate is not None
        for _ in range(n):
            self.gate.release()

    async def __call__(self, sent: Sent) -> Reply:
        data = sent.json()
        self.bodies.append(data)
        self.arrivals.append(data["messages"][-1]["content"])
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        streaming = False
        try:
            if self.gate is not None:
                self.waiting += 1
                try:
                    await self.gate.acquire()
                finally:
                    self.waiting -= 1
            if self.status != 200:
                headers = (("Retry-After", self.retry_after),) if self.retry_after else ()
                error = {"error": {"message": f"{self.name} fails", "type": "server_error"}}
                return json_reply(error, self.status, headers)
            if data.get("stream"):
                streaming = True
                return Reply(200, SSE, stream=self._stream(asks_usage(data)))
            content = [{"token": "w", "logprob": self.logprob}] * 4
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": f"{self.name} answers"},
                "logprobs": {"content": content} if data.get("logprobs") else None,
                "finish_reason": "stop",
            }
            usage = {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}
            answer = {"id": "c", "object": "chat.completion", "choices": [choice], "usage": usage}
            return json_reply(answer)
        finally:
            if not streaming:
                self.active -= 1

    async def _stream(self, usage: bool = False) -> AsyncIterator[bytes]:
        """Six content chunks, then, when asked (``stream_options.include_usage``), a
        usage-only chunk (``STREAM_USAGE``), then ``[DONE]``."""
        try:
            for i in range(6):
                if self.break_stream_after is not None and i == self.break_stream_after:
                    raise UpstreamUnavailable(
                        "the backend closed the connection mid-body", backend=self.name
                    )
                chunk = {"choices": [{"index": 0, "delta": {"content": f"{self.name}{i} "}}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
                if i == 0 and self.mid_stream is not None:
                    await self.mid_stream.wait()  # the stream has started; on when set
            if usage:
                last: dict[str, Any] = {"choices": [], "usage": STREAM_USAGE}
                yield f"data: {json.dumps(last)}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            self.active -= 1

    def __repr__(self) -> str:
        return f"<Model {self.name} status={self.status} arrivals={len(self.arrivals)}>"


def vector(text: Any) -> list[float]:
    """``ArrayModel``'s embedding: a function of the input only."""
    s = str(text)
    return [float(len(s)), float(sum(map(ord, s)) % 997)]


def embed(text: Any, **fields: Any) -> dict[str, Any]:
    """An OpenAI embeddings request."""
    return {"model": "e5", "input": text, **fields}


@dataclass
class Seen:
    """One call as ``ArrayModel`` received it."""

    path: str
    inputs: list[Any]
    body: dict[str, Any]
    authorization: str


class ArrayModel:
    """A tiny model server speaking every batchable API (OpenAI embeddings and completions,
    TEI ``/embed``, KServe V2 infer, TF Serving predict), answering deterministically from
    each input.  ``calls`` records each call it served; while ``gate`` is clear it holds
    its answers (the backend is busy); ``oom_above`` makes bigger batches fail as a GPU out
    of memory does; an input ``POISON`` is refused with a 400."""

    def __init__(self) -> None:
        self.calls: list[Seen] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.oom_above: int | None = None

    def sizes(self, path: str | None = None) -> list[int]:
        return [len(c.inputs) for c in self.calls if path is None or c.path == path]

    async def __call__(self, sent: Sent) -> Reply:
        path = sent.target.partition("?")[0]
        body = sent.json()
        if path == "/v1/embeddings":
            inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
            await self._record(sent, path, inputs, body)
            return self._embeddings(body, inputs)
        if path == "/v1/completions":
            prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
            await self._record(sent, path, prompts, body)
            return self._completions(body, prompts)
        if path == "/embed":
            inputs = body["inputs"] if isinstance(body["inputs"], list) else [body["inputs"]]
            await self._record(sent, path, inputs, body)
            return json_reply([vector(t) for t in inputs])
        if path.startswith("/v2/models/") and path.endswith("/infer"):
            return await self._kserve(sent, path, body)
        if path.startswith("/v1/models/") and path.endswith(":predict"):
            await self._record(sent, path, body["instances"], body)
            return json_reply({"predictions": [sum(i) for i in body["instances"]]})
        return json_reply({"error": {"message": f"no route {path}"}}, 404)

    async def _record(self, sent: Sent, path: str, inputs: list[Any], body: Any) -> None:
        self.calls.append(Seen(path, inputs, body, sent.header("Authorization") or ""))
        await self.gate.wait()

    def _embeddings(self, body: dict[str, Any], inputs: list[Any]) -> Reply:
        if "POISON" in inputs:
            return json_reply({"error": {"message": "bad input POISON"}}, 400)
        if self.oom_above is not None and len(inputs) > self.oom_above:
            message = "CUDA out of memory. Tried to allocate 2.00 GiB"
            return json_reply({"error": {"message": message}}, 500)
        data = [
            {"object": "embedding", "index": i, "embedding": vector(t)}
            for i, t in enumerate(inputs)
        ]
        data.reverse()  # order is not promised: answers are matched by index
        tokens = sum(len(str(t).split()) for t in inputs)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return json_reply({"object": "list", "data": data, "model": body["model"], "usage": usage})

    def _completions(self, body: dict[str, Any], prompts: list[Any]) -> Reply:
        choices = [
            {"index": i, "text": f"{p}!", "finish_reason": "stop", "logprobs": None}
            for i, p in enumerate(prompts)
        ]
        if body.get("stream"):
            events = [
                b"data: " + json.dumps({"object": "text_completion", "choices": [c]}).encode()
                for c in choices
            ]
            return stream_reply([e + b"\n\n" for e in events] + [b"data: [DONE]\n\n"])
        usage = {"prompt_tokens": 2 * len(prompts), "completion_tokens": len(prompts)}
        usage["total_tokens"] = 3 * len(prompts)
        return json_reply({"object": "text_completion", "choices": choices, "usage": usage})

    async def _kserve(self, sent: Sent, path: str, body: dict[str, Any]) -> Reply:
        (tensor,) = body["inputs"]
        rows, width = tensor["shape"]
        flat = tensor["data"]
        await self._record(
            sent, path, [flat[r * width : (r + 1) * width] for r in range(rows)], body
        )
        out = {
            "name": "out",
            "datatype": "FP32",
            "shape": [rows, width],
            "data": [2 * x for x in flat],
        }
        answer: dict[str, Any] = {"model_name": path.split("/")[3], "outputs": [out]}
        if "id" in body:
            answer["id"] = body["id"]
        return json_reply(answer)


@dataclass
class BatchRig:
    """A gateway (without sockets) in front of an ``ArrayModel``, and what the batching
    tests ask of it."""

    model: ArrayModel
    gw: Pipeline
    policy_path: Path

    async def post(
        self, path: str, body: Any, *, auth: str = "Bearer tenant-a"
    ) -> tuple[int, Any, Any]:
        answer = await self.gw.post(path, body, headers={"Authorization": auth})
        return answer.status_code, answer.json(), answer.headers

    def batcher(self, route: str) -> Batcher:
        registry = self.gw.gateway.registry
        found = [b for name, b in registry.items(BATCHERS) if name.startswith(route + " ")]
        assert len(found) == 1, found
        return found[0]

    def waiting(self) -> int:
        """Requests waiting in every batcher."""
        return sum(b.waiting for _, b in self.gw.gateway.registry.items(BATCHERS))

    async def busy(self, path: str, body: Any) -> asyncio.Task[Any]:
        """One request held upstream: from now on the backend is busy."""
        self.model.gate.clear()
        before = len(self.model.calls)
        task = asyncio.ensure_future(self.post(path, body))
        await until(lambda: len(self.model.calls) == before + 1)
        return task

    def metric(self, name: str, **labels: str) -> float:
        """The first series of ``name`` whose labels include ``labels``."""
        text = self.gw.gateway.metrics.exposition().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    return float(sample.value)
        raise AssertionError(f"no sample {name}{labels}")
