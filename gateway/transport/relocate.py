"""A backend's own URL in an answer's ``Location``, told as the gateway's path.

A backend builds a redirect or a created object's URL from the request it got, so it names
itself: Starlette and FastAPI (vLLM, MLServer, LiteLLM) answer a path spelled with a
trailing slash where theirs has none, or the other way round, with ``307 Location:
http://127.0.0.1:8000/<the path they have>``; Gin (Ollama) with a 301 or 307 the same way.
(A known API's path is trimmed of that slash at the edge, ``server.target``; a backend's own
paths are not the gateway's to know.) Passed on as it is, that sends the client straight to
the backend's address: unreachable from the client (a sidecar's backend listens on the pod's
loopback), or reachable and then past everything the gateway does on that path (tenant
checks, cache, limits). So, as nginx's ``proxy_redirect default`` does, a ``Location`` or
``Content-Location`` naming the backend's URL (its scheme, host and port, and the path
prefix of a backend URL such as ``http://host:8000/openai``) becomes the path the client
asks the gateway for: ``/api/generate``, resolved by the client against the gateway's own
address, where the next request is checked like any other. A path below the backend's prefix
(``/openai/v1/models``) loses the prefix. A URL naming anything else (another host, another
port, a relative path outside the prefix) passes as it is.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from gateway.pipeline import Headers

_URL_HEADERS = frozenset({"location", "content-location"})
_DEFAULT_PORTS = {"http": 80, "https": 443}


class Relocation:
    """Rewrites URLs naming one backend URL (``base_url``, without a trailing slash)."""

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        self._origin = _origin(parts.scheme, parts.hostname, parts.port)
        self._prefix = parts.path.rstrip("/")

    def headers(self, headers: Headers) -> Headers:
        """``headers`` with each URL naming the backend told as the gateway's path."""
        if not any(key.lower() in _URL_HEADERS for key, _ in headers):
            return headers  # the common case: no URL to tell
        return tuple(
            (key, self.url(value)) if key.lower() in _URL_HEADERS else (key, value)
            for key, value in headers
        )

    def url(self, value: str) -> str:
        """``value`` as the gateway's path when it names the backend; else as it is."""
        text = value.strip()
        if text.startswith("/") and not text.startswith("//"):
            path, rest = _split(text)
        else:
            try:
                parts = urlsplit(text)
                origin = _origin(parts.scheme, parts.hostname, parts.port)
            except ValueError:  # a port out of range, a bracket unclosed
                return value
            if origin is None or origin != self._origin:
                return value
            path, rest = _split(text[len(parts.scheme) + 3 + len(parts.netloc) :])
            path = path or "/"
        if self._prefix:
            if path != self._prefix and not path.startswith(self._prefix + "/"):
                return value  # outside the part of the backend the gateway fronts
            path = path[len(self._prefix) :] or "/"
        return path + rest

    def __repr__(self) -> str:
        return f"<Relocation {self._origin} {self._prefix or '/'}>"


def _origin(scheme: str, host: str | None, port: int | None) -> tuple[str, str, int] | None:
    scheme = scheme.lower()
    if scheme not in _DEFAULT_PORTS or not host:
        return None
    return scheme, host.lower(), port if port is not None else _DEFAULT_PORTS[scheme]


def _split(reference: str) -> tuple[str, str]:
    """A reference's path, and its query and fragment as written."""
    cut = min((i for i in (reference.find("?"), reference.find("#")) if i >= 0), default=-1)
    return (reference, "") if cut < 0 else (reference[:cut], reference[cut:])
