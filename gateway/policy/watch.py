"""Where policies come from, and noticing when they change.

A ``PolicySource`` is a path (a file, or a directory such as a Kubernetes ConfigMap volume)
or a fixed policy (``gateway serve --upstream``).  Changes are found by hashing the files'
contents on every poll: that follows the ConfigMap's ``..data`` symlink swap, which a watch
on the file itself would miss, and costs microseconds for policy-sized files.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..errors import PolicyError
from .load import Loaded, parse_sources, read_sources
from .model import Policy


class PolicySource:
    """A policy path to (re)read, or a fixed policy."""

    def __init__(self, path: str | Path | None = None, fixed: Policy | None = None) -> None:
        if (path is None) == (fixed is None):
            raise ValueError("give a policy path or a fixed policy, not both")
        self.path = Path(path) if path is not None else None
        self._fixed = fixed

    @property
    def watchable(self) -> bool:
        return self.path is not None

    def fingerprint(self) -> str:
        """A hash of the raw sources, to tell cheaply whether anything changed."""
        if self.path is None:
            return "fixed"
        h = hashlib.sha256()
        try:
            for name, text in read_sources(self.path):
                h.update(name.encode() + b"\0" + text.encode() + b"\0")
        except PolicyError as exc:
            h.update(str(exc).encode())
        return h.hexdigest()

    def load(self) -> Loaded:
        """Read and validate (raises PolicyError)."""
        if self._fixed is not None:
            return Loaded(
                self._fixed, hashlib.sha256(repr(self._fixed).encode()).hexdigest()[:16], ()
            )
        assert self.path is not None
        return parse_sources(read_sources(self.path))

    def __repr__(self) -> str:
        return f"<PolicySource {self.path or 'fixed'}>"
