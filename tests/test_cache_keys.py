"""Which requests are cacheable and what their keys include."""

from __future__ import annotations

from typing import Any, Literal, TypedDict

import pytest

from gateway.cache import cacheability, request_key, scope_hash
from gateway.cache.keys import MAX_NEAR_CHARS, RequestKey, with_context
from gateway.tenant import CREDENTIAL_HEADERS

CHAT = "/v1/chat/completions"


class Place(TypedDict):
    """Where a request is answered, less its scope: ``with_context``'s keyword arguments."""

    route: str
    backend: str
    model_version: str
    path: str


class Where(Place):
    """``request_key``'s keyword arguments: a place and a scope."""

    scope: str


PLACE: Place = {"route": "r", "backend": "main", "model_version": "v1", "path": CHAT}
WHERE: Where = {"scope": "s", **PLACE}


def chat(text: str = "hi", **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "temperature": 0,
        "messages": [{"role": "user", "content": text}],
        **extra,
    }


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"model": "m", "messages": []}, "temperature is not set to 0"),
        (chat(temperature=0.7), "temperature is not 0"),
        (chat(temperature=True), "temperature is not set to 0"),
        (chat(n=2), "n is not 1"),
        ({"model": "m", "prompt": "x", "temperature": 0, "best_of": 3}, "best_of is not 1"),
    ],
)
def test_nondeterministic_requests_are_not_cacheable(body: dict[str, Any], reason: str) -> None:
    verdict = cacheability(body, CHAT)
    assert not verdict.ok and verdict.reason == reason


def test_greedy_requests_and_embeddings_are_cacheable() -> None:
    assert cacheability(chat(), CHAT).ok
    assert cacheability(chat(temperature=0.0, n=1), CHAT).ok
    assert cacheability({"model": "e", "input": ["a"]}, "/v1/embeddings").ok


def test_sampled_requests_cacheable_only_with_opt_in() -> None:
    assert cacheability(chat(temperature=0.9), CHAT, allow_sampled=True).ok
    assert not cacheability(chat(temperature=0.9, n=3), CHAT, allow_sampled=True).ok


def test_remote_image_urls_are_not_cacheable() -> None:
    part: dict[str, Any] = {
        "type": "image_url",
        "image_url": {"url": "https://example.com/cat.png"},
    }
    body = chat()
    body["messages"][0]["content"] = [{"type": "text", "text": "what is this"}, part]
    assert cacheability(body, CHAT).reason == "a message refers to a remote URL"
    part["image_url"]["url"] = "data:image/png;base64,AAAA"
    assert cacheability(body, CHAT).ok


def test_delivery_and_attribution_fields_do_not_change_the_key() -> None:
    base = request_key(chat(), **WHERE)
    same = chat(stream=True, stream_options={"include_usage": True}, user="u", metadata={"a": 1})
    assert request_key(same, **WHERE).exact == base.exact
    assert request_key(chat(temperature=0.0), **WHERE).exact == base.exact


@pytest.mark.parametrize(
    "change",
    [
        {"max_tokens": 5},
        {"seed": 1},
        {"stop": ["\n"]},
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        {"response_format": {"type": "json_object"}},
        {"unknown_vendor_field": 1},
        {"model": "other"},
    ],
)
def test_answer_changing_fields_change_the_key(change: dict[str, Any]) -> None:
    assert request_key(chat(**change), **WHERE).exact != request_key(chat(), **WHERE).exact


@pytest.mark.parametrize("field", ["scope", "route", "backend", "model_version", "path"])
def test_scope_route_backend_model_version_and_path_are_in_the_key(
    field: Literal["scope", "route", "backend", "model_version", "path"],
) -> None:
    other = WHERE.copy()
    other[field] += "x"
    a, b = request_key(chat(), **WHERE), request_key(chat(), **other)
    assert a.exact != b.exact and a.context != b.context


def test_context_key_ignores_only_the_final_user_text() -> None:
    a = request_key(chat("What is 2+2?"), **WHERE)
    b = request_key(chat("what is 2 + 2"), **WHERE)
    assert a.exact != b.exact and a.context == b.context
    assert (a.prompt, b.prompt) == ("What is 2+2?", "what is 2 + 2")
    system = chat("What is 2+2?")
    system["messages"].insert(0, {"role": "system", "content": "be terse"})
    assert request_key(system, **WHERE).context != a.context


def test_near_tier_applies_only_to_a_final_plain_text_user_message() -> None:
    assistant_last = chat()
    assistant_last["messages"].append({"role": "assistant", "content": "prefill"})
    assert request_key(assistant_last, **WHERE).context is None
    one_part = chat()
    one_part["messages"][0]["content"] = [{"type": "text", "text": "hi"}]
    assert request_key(one_part, **WHERE).prompt == "hi"
    completions = {"model": "m", "prompt": "hi", "temperature": 0}
    assert request_key(completions, **(WHERE | {"path": "/v1/completions"})).context is None


def test_near_tier_skips_a_message_longer_than_max_near_chars() -> None:
    """A document-sized message gets the exact tier only: its normalisation would cost the
    event loop time in proportion to it, and the models read only its beginning."""
    longest = "x" * MAX_NEAR_CHARS
    assert request_key(chat(longest), **WHERE).prompt == longest
    body = chat(longest + "y")
    key = request_key(body, **WHERE)
    assert key.context is None and key.prompt is None and key.exact
    first = request_key(body, near=False, **WHERE)
    assert with_context(first, body, **PLACE).context is None


def test_scope_hash_is_the_one_every_stored_key_was_made_with() -> None:
    """Entries in a shared store outlive a gateway version: the scope hash of the same
    credentials must not change, or every entry would be lost at an upgrade."""
    headers = [("Authorization", "Bearer  sk-1"), ("Cookie", "a=b"), ("x-api-key", "k")]
    assert scope_hash(headers, CREDENTIAL_HEADERS) == "405098158bc83aff518193f0f46fc8dd"
    assert scope_hash([], ()) == "7588ad43d13a6a5a0343f50ed4e7542b"


def test_scope_hash_hides_values_and_separates_tenants() -> None:
    a = scope_hash([("Authorization", "Bearer secret-a")], ["authorization"])
    assert "secret" not in a and len(a) == 32
    assert a == scope_hash([("authorization", "Bearer secret-a")], ["Authorization"])
    assert a != scope_hash([("Authorization", "Bearer secret-b")], ["authorization"])
    missing = scope_hash([], ["authorization"])
    assert missing != scope_hash([("Authorization", "")], ["authorization"])
    two = ["authorization", "x-tenant"]
    assert scope_hash([("x-tenant", "t1")], two) != scope_hash([("x-tenant", "t2")], two)


BLANK = "\x00final-user-message\x00"
"""The placeholder a context key's JSON holds instead of the final user text."""
SYSTEM_BLANK_ONE_PART = {
    "model": "m",
    "temperature": 0.0,
    "messages": [
        {"role": "system", "content": BLANK},
        {"role": "user", "content": [{"type": "text", "text": 'Héllo "there"'}]},
    ],
}
PINNED = [
    (
        chat("What is 2+2?"),
        "248fcf3cda7184ab28343e25b70a119d38af195c",
        "5705e92ad1994bf8c0061ff6e8905dcaf275ad96",
    ),
    (
        chat("hi", tool_choice=BLANK),
        "bff6121112db5b337f393659a1badde59c7ee49b",
        "1c33b87c14b26c3378cbd098b8a56f90e4110348",
    ),
    (
        chat(BLANK),
        "c26fb40f8a227ed1b23455c3ef1fb30cf5ee9195",
        "ce844a936c2a2dace76d7f67cb1b08306061a33c",
    ),
    (
        SYSTEM_BLANK_ONE_PART,
        "c4af688ea6f3115d98c86d0cc83b06b1ad5a0fa6",
        "f016b4b0cfc8b8b8f4f67121cf5cc3c59401d18e",
    ),
]


@pytest.mark.parametrize(("body", "exact", "context"), PINNED)
def test_keys_are_stable_across_versions(body: dict[str, Any], exact: str, context: str) -> None:
    """Stored entries are found by these keys: changing them strands every stored entry, so
    only a new key version may.  Bodies holding the placeholder's own text included."""
    key = request_key(body, **WHERE)
    assert (key.exact, key.context) == (exact, context)


@pytest.mark.parametrize("body", [body for body, _, _ in PINNED])
def test_keys_are_the_same_however_they_are_built(body: dict[str, Any]) -> None:
    """The exact-first path (``near=False``, then ``with_context``) and a hand-built key
    given its context give the key ``request_key`` gives at once."""
    full = request_key(body, **WHERE)
    first = request_key(body, near=False, **WHERE)
    assert first.exact == full.exact and first.context is None
    assert with_context(first, body, **PLACE) == full
    assert with_context(RequestKey(full.scope, full.exact), body, **PLACE) == full
