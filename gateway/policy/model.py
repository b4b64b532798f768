"""The policy model: frozen dataclasses that a YAML policy is parsed into.

Every field's ``metadata["doc"]`` is the reference text for ``docs/policy.md`` and the
JSON Schema; defaults are the named constants below.  A field marked ``keyed`` is written
in YAML as a mapping from name to object (``backends: {main: {...}}``) and held here as a
tuple of objects whose ``name`` is that key.  ``secret`` fields are redacted wherever a
policy is shown; ``env`` fields expand ``${NAME}`` from the environment at load time.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Literal

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_STREAM_TIMEOUT_S = 600.0
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_IDLE_TIMEOUT_S = 60.0
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_SHUTDOWN_GRACE_S = 25.0
DEFAULT_RELOAD_INTERVAL_S = 1.0
DEFAULT_WARMUP_TIMEOUT_S = 300.0


def _doc(text: str, **extra: Any) -> dict[str, Any]:
    return {"doc": text, **extra}


@dataclass(frozen=True, slots=True)
class WarmupRequest:
    """A request sent to a backend before the gateway reports ready."""

    path: str = field(metadata=_doc("Path of the warm-up request, e.g. `/v1/chat/completions`."))
    method: Literal["GET", "POST"] = field(default="POST", metadata=_doc("HTTP method."))
    body: Any = field(default=None, metadata=_doc("JSON body sent as is (none for GET)."))


@dataclass(frozen=True, slots=True)
class Backend:
    """A model server the gateway forwards to."""

    name: str = field(metadata=_doc("The backend's name (its key under `backends`)."))
    url: str = field(metadata=_doc("Base URL, `http://` or `https://`; paths are appended."))
    model_version: str = field(
        default="",
        metadata=_doc(
            "Version of the model served; part of every cache key, so bumping it "
            "invalidates that backend's cached answers at once."
        ),
    )
    timeout_s: float = field(
        default=DEFAULT_TIMEOUT_S,
        metadata=_doc("Total time for a non-streaming exchange, headers and body (504 past it)."),
    )
    stream_timeout_s: float = field(
        default=DEFAULT_STREAM_TIMEOUT_S,
        metadata=_doc(
            "Total time for a streaming (SSE) exchange; long generations need more "
            "than `timeout_s`."
        ),
    )
    connect_timeout_s: float = field(
        default=DEFAULT_CONNECT_TIMEOUT_S, metadata=_doc("Time to open a TCP/TLS connection.")
    )
    idle_timeout_s: float = field(
        default=DEFAULT_IDLE_TIMEOUT_S,
        metadata=_doc(
            "Longest silence between two chunks of a response (504 before the first "
            "byte, stream cut after it)."
        ),
    )
    max_connections: int = field(
        default=DEFAULT_MAX_CONNECTIONS,
        metadata=_doc(
            "Keep-alive pool size. Requests past it queue inside the pool, so never "
            "set it below the backend's own concurrency."
        ),
    )
    headers: tuple[tuple[str, str], ...] = field(
        default=(),
        metadata=_doc(
            "Extra headers sent upstream (e.g. an API key). Values may use "
            "`${ENV_NAME}`; they are redacted wherever the policy is shown.",
            mapping=True,
            secret=True,
            env=True,
        ),
    )
    ca_bundle: str | None = field(
        default=None, metadata=_doc("PEM file of CAs for an `https` backend (system CAs if unset).")
    )
    verify_tls: bool = field(
        default=True, metadata=_doc("Verify the `https` backend's certificate. Leave on.")
    )
    warmup: tuple[WarmupRequest, ...] = field(
        default=(),
        metadata=_doc(
            "Requests sent at start; `/readyz` stays unready until each has answered, "
            "so the first user request never pays the cold start."
        ),
    )
    warmup_timeout_s: float = field(
        default=DEFAULT_WARMUP_TIMEOUT_S,
        metadata=_doc("How long warm-up keeps retrying a backend that is still starting."),
    )


@dataclass(frozen=True, slots=True)
class Match:
    """What a route matches: a path glob and, optionally, the JSON body's `model`."""

    path: str = field(
        default="*",
        metadata=_doc(
            "Shell-style glob on the path (`*` crosses `/`: `/v1/*` matches "
            "`/v1/chat/completions`)."
        ),
    )
    model: str | None = field(
        default=None, metadata=_doc("Glob on the body's `model` (OpenAI endpoints only).")
    )


@dataclass(frozen=True, slots=True)
class Route:
    """A rule sending matching requests to a backend; the first matching route wins."""

    backend: str = field(metadata=_doc("Name of the backend serving this route."))
    match: Match = field(default_factory=Match, metadata=_doc("What the route matches."))
    name: str = field(
        default="",
        metadata=_doc(
            "Name used in metrics and logs; defaults to the path glob (plus the model glob)."
        ),
    )


@dataclass(frozen=True, slots=True)
class Admin:
    """The admin listener's settings."""

    token: str | None = field(
        default=None,
        metadata=_doc(
            "Bearer token for mutating admin endpoints (`POST /reload`, ...). "
            "`GATEWAY_ADMIN_TOKEN` overrides it. With none, those endpoints answer "
            "only on a loopback-bound admin port.",
            secret=True,
            env=True,
        ),
    )


@dataclass(frozen=True, slots=True)
class Server:
    """Gateway-wide settings of the data plane."""

    max_body_bytes: int = field(
        default=DEFAULT_MAX_BODY_BYTES,
        metadata=_doc("Largest request body accepted (413 past it)."),
    )
    shutdown_grace_s: float = field(
        default=DEFAULT_SHUTDOWN_GRACE_S,
        metadata=_doc("On SIGTERM, how long in-flight requests and streams may take to finish."),
    )
    reload_interval_s: float = field(
        default=DEFAULT_RELOAD_INTERVAL_S,
        metadata=_doc(
            "How often the policy path is polled for changes (SIGHUP and "
            "`POST /reload` reload at once)."
        ),
    )
    access_log: bool = field(
        default=False,
        metadata=_doc("One JSON line per request on stderr (no bodies, no credentials)."),
    )


@dataclass(frozen=True, slots=True)
class Metrics:
    """Prometheus exposition settings."""

    const_labels: tuple[tuple[str, str], ...] = field(
        default=(),
        metadata=_doc(
            "Labels added to every gateway series, e.g. `{model_version: ..., gpu_type: h200}`.",
            mapping=True,
        ),
    )


@dataclass(frozen=True, slots=True)
class Policy:
    """A whole policy: what the gateway forwards where, and how."""

    backends: tuple[Backend, ...] = field(
        default=(), metadata=_doc("Model servers, by name.", keyed="name")
    )
    routes: tuple[Route, ...] = field(
        default=(), metadata=_doc("Routing rules, tried in order; the first match wins.")
    )
    server: Server = field(default_factory=Server, metadata=_doc("Data-plane settings."))
    admin: Admin = field(default_factory=Admin, metadata=_doc("Admin listener settings."))
    metrics: Metrics = field(default_factory=Metrics, metadata=_doc("Metrics settings."))

    def backend(self, name: str) -> Backend:
        """The backend called ``name`` (cross-references are checked at load)."""
        for backend in self.backends:
            if backend.name == name:
                return backend
        raise KeyError(name)


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A compiled shell-style glob where `*` also crosses `/` (as ``fnmatch``)."""
    return re.compile(fnmatch.translate(pattern))
