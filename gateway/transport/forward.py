"""The pipeline's last handler: sends a call to its backend through the transport."""

from __future__ import annotations

from gateway.openai.prefix import leading_key
from gateway.pipeline import Call, Reply
from gateway.transport.upstream import Transport


class Forward:
    """Forwards a call to ``call.backend`` with the backend's extra headers added."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    async def __call__(self, call: Call) -> Reply:
        backend = call.policy.backend(call.backend)
        headers = list(call.headers)
        if backend.headers:
            names = {k.lower() for k, _ in backend.headers}
            headers = [(k, v) for k, v in headers if k.lower() not in names]
            headers.extend(backend.headers)
        path_qs = call.raw_target or call.path + ("?" + call.query if call.query else "")
        return await self._transport.send(
            backend,
            call.method,
            path_qs,
            headers,
            call.body,
            streaming=call.streaming,
            affinity=leading_key(call.json) if backend.prefix_affinity else None,
            pin=call.pin,
            model=model_of(call) if backend.balance == "kv_aware" else None,
            spare=call.spare,
        )

    def __repr__(self) -> str:
        return f"<Forward transport={self._transport!r}>"


def model_of(call: Call) -> str | None:
    """The model an OpenAI or Anthropic JSON body asks for."""
    model = call.json.get("model") if call.json is not None else None
    return model if isinstance(model, str) else None
