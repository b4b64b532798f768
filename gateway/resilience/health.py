"""What an answer says about its backend's health, recorded for the breaker: failures by
reason (``gateway_backend_failures_total``), streams judged when they end, and a merged
batch call's failures held until the batcher rules whose fault they were.

Health is the backend's, faults are the caller's: a 4xx is the caller's; a 5xx of a merged
batch call whose bisection pinned it on one caller's input (its siblings answered) is that
input's, and counts neither for the merged call nor for its halves (Envoy's outlier
detection tells local-origin errors from upstream ones the same way).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from gateway.errors import UpstreamError
from gateway.openai.sse import StreamCheck
from gateway.pipeline import Call, Reply
from gateway.resilience.breaker import Outcome
from gateway.resilience.guard import Pass
from gateway.transport.headers import is_event_stream

_STREAMED_PATHS = ("/chat/completions", "/completions")


Failed = Callable[[str], None]
"""Counts a failure of the call's backend by reason (``gateway_backend_failures_total``)."""


def account(call: Call, reply: Reply, passed: Pass, failed: Failed) -> Reply:
    """Record how the call went for the breaker, and give the slot back when it is done
    (a stream's reply is returned with its stream judged and its close giving the slot
    back).

    A failure at the head counts at once, unless the call is a merged batch call: then it
    counts once the batcher has ruled whether the failure was the backend's or a caller's
    input (``Verdict``).  A whole body is done now: an OpenAI answer that is not even shaped
    like a JSON object counts as the failure it is.  A stream is judged when it ends: cut,
    left idle mid-way or misframed (an ``UpstreamError`` while it is read) it fails; an
    OpenAI chat or completions stream is judged by its events too (``StreamCheck``: an error
    event, no ``[DONE]`` or ``finish_reason``, unparseable data), and an event stream is no
    answer to a call that asked for none; abandoned by its client a stream does not count."""
    at_head = Outcome.of_status(reply.status)
    if reply.stream is None:
        body = reply.body or b""
        reason = "status_5xx"
        if at_head is Outcome.SUCCESS and call.json is not None and not _json_shaped(body):
            at_head, reason = Outcome.FAILURE, "not_json"
        if at_head is Outcome.FAILURE and call.verdict is not None and reason == "status_5xx":
            passed.release_slot()
            call.verdict.hold(_ruling(passed, failed))
            return reply
        if at_head is Outcome.FAILURE:
            failed(reason)
        passed.record(at_head)
        passed.release()
        return reply
    stream = reply.stream
    if at_head is not Outcome.SUCCESS:
        if at_head is Outcome.FAILURE:
            failed("status_5xx")
        passed.record(at_head)
    else:
        judge = FRAMING
        if judged_openai(call) and is_event_stream(reply.headers):
            judge = EVENTS if call.streaming else UNASKED
        stream = _judged_stream(stream, passed, failed, judge)
    return reply.replace(stream=stream).when_done(passed.release)


def judged_openai(call: Call) -> bool:
    """Whether ``call`` is an OpenAI chat or completions call, whose streams are judged by
    their events."""
    return call.json is not None and call.path.endswith(_STREAMED_PATHS)


def _ruling(passed: Pass, failed: Failed) -> Callable[[bool], None]:
    def settle(fault: bool) -> None:
        failed("status_5xx" if fault else "batch_input")
        passed.record(Outcome.FAILURE if fault else Outcome.IGNORED)

    return settle


FRAMING, EVENTS, UNASKED = "framing", "events", "unasked"
"""How a stream is judged: by its framing only; by its events too (an OpenAI chat or
completions stream); as a failure whatever it holds (an event stream answering a call that
asked for none)."""


async def _judged_stream(
    stream: AsyncIterator[bytes], passed: Pass, failed: Failed, judge: str
) -> AsyncIterator[bytes]:
    """``stream``, its outcome recorded once it has ended (not when its client left)."""
    check = StreamCheck() if judge == EVENTS else None
    try:
        async for chunk in stream:
            if check is not None:
                check.feed(chunk)
            yield chunk
    except UpstreamError:
        failed("broken_stream")
        passed.record(Outcome.FAILURE)
        raise
    problem = check.problem() if check is not None else None
    if judge == UNASKED:
        problem = "unexpected_stream"
    if problem is not None:
        failed(problem)
        passed.record(Outcome.FAILURE)
    else:
        passed.record(Outcome.SUCCESS)


def _json_shaped(body: bytes) -> bool:
    """Whether an answer could be a JSON object: its first and last non-blank bytes."""
    return body.lstrip()[:1] == b"{" and body.rstrip()[-1:] == b"}"
