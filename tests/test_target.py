"""Request-target normalisation (RFC 3986 5.2.4 and 6.2.2, RFC 9112 3.2): what routing
matches is exactly what is forwarded."""

from __future__ import annotations

import pytest

from gateway.errors import MalformedRequest
from gateway.server.target import normalise, remove_dot_segments


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("/v1/models", ("/v1/models", "")),
        ("/v1/models?limit=5&x=%2F", ("/v1/models", "limit=5&x=%2F")),
        ("/v1/../internal/secret", ("/internal/secret", "")),
        ("/v1/./models/.", ("/v1/models", "")),
        ("/v1/chat/completions/", ("/v1/chat/completions", "")),  # a known API's: trimmed
        ("/v1/models/Qwen/Qwen2.5-7B/?x=/", ("/v1/models/Qwen/Qwen2.5-7B", "x=/")),
        ("/v2/models/m/infer//", ("/v2/models/m/infer", "")),
        ("/v1/files/./", ("/v1/files", "")),
        ("/V1/Chat/completions/", ("/V1/Chat/completions", "")),  # then refused for its case
        ("/v1/", ("/v1/", "")),  # no API named: as it is
        ("/v1/custom/", ("/v1/custom/", "")),
        ("/api/generate/", ("/api/generate/", "")),
        ("/", ("/", "")),
        ("/a/b/..", ("/a/", "")),
        ("/../../etc/passwd", ("/etc/passwd", "")),
        ("//v1///models", ("/v1/models", "")),
        ("/v1//../models", ("/models", "")),  # slashes merge first, as nginx does
        ("/v1/%63hat/%7Euser", ("/v1/chat/~user", "")),
        ("/a%20b%3a", ("/a%20b%3A", "")),
        ("/.well-known/x", ("/.well-known/x", "")),
        ("/a/..b/c.", ("/a/..b/c.", "")),
        ("http://admin.internal/v1/models?x=1", ("/v1/models", "x=1")),
        ("HTTPS://user:pw@admin.internal:8443", ("/", "")),
        ("http://h?q=1", ("/", "q=1")),
    ],
)
def test_targets_normalise_to_one_spelling(target, expected):
    assert normalise(target) == expected


@pytest.mark.parametrize(
    "target",
    [
        "/v1/%2e%2e/internal",
        "/v1/%2E./internal",
        "/v1/.%2e/internal",
        "/v1/%2e/internal",
        "/v1/..%2Finternal",
        "/v1/a%2fb",
        "/v1/a%5Cb",
        "/v1\\..\\internal",
        "/v1/%zz",
        "/v1/%4",
        "/v1/models#frag",
        "*",
        "admin.internal:443",
        "ftp://admin.internal/v1",
    ],
)
def test_targets_that_hide_a_separator_or_a_parent_step_are_refused(target):
    with pytest.raises(MalformedRequest) as refused:
        normalise(target)
    assert refused.value.status == 400


def test_dot_segment_removal_follows_rfc_3986_examples():
    """RFC 3986 5.4's normal and abnormal examples, on absolute paths."""
    assert remove_dot_segments("/a/b/c/./../../g") == "/a/g"
    assert remove_dot_segments("/b/c/../../../g") == "/g"
    assert remove_dot_segments("/b/c/./g/.") == "/b/c/g/"
    assert remove_dot_segments("/b/c/g/..") == "/b/c/"
    assert remove_dot_segments("/b/c/..g") == "/b/c/..g"
