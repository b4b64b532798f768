"""The ``model_version`` each backend's cached answers are keyed by: the policy's, or, for
``model_version: auto``, what the backend's servers say they serve now
(``transport.identity``), read per call so new weights take new keys at once."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gateway.policy.model import Backend
from gateway.transport.identity import AUTO, UNKNOWN

__all__ = ["UNKNOWN", "Versions"]


class Versions:
    """The version of each backend, by name."""

    def __init__(self, backends: Iterable[Backend], transport: object) -> None:
        self._fixed = {b.name: b.model_version for b in backends}
        # the real transport's (``Upstreams.model_identity``); a fake one knows no weights
        self._asked: Callable[[str, str | None], str | None] | None = getattr(
            transport, "model_identity", None
        )

    def get(self, name: str, default: str = "", body: Mapping[str, Any] | None = None) -> str:
        """The version of the backend ``name`` for a call with ``body`` (the model it
        names: ``Identities.version_for``); ``UNKNOWN``: an ``auto`` one not yet known,
        under which nothing is stored."""
        version = self._fixed.get(name, default)
        if version != AUTO or self._asked is None:
            return UNKNOWN if version == AUTO else version
        model = body.get("model") if body is not None else None
        return self._asked(name, model if isinstance(model, str) else None) or UNKNOWN

    def __repr__(self) -> str:
        return f"<Versions {sorted(self._fixed)}>"
