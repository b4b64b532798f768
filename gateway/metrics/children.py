"""A counter family's children under fixed leading labels, each looked up once: a label
lookup takes the family's lock, and these are counted per request."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter


class Counted:
    """``family``'s children whose leading labels are ``fixed``, by their other labels."""

    __slots__ = ("_children", "_family", "_fixed")

    def __init__(self, family: Counter, *fixed: str) -> None:
        self._family = family
        self._fixed = fixed
        self._children: dict[tuple[str, ...], Any] = {}

    def inc(self, *labels: str) -> None:
        child = self._children.get(labels)
        if child is None:
            child = self._children[labels] = self._family.labels(*self._fixed, *labels)
        child.inc()

    def __repr__(self) -> str:
        return f"<Counted {self._family._name} {self._fixed} seen={sorted(self._children)}>"
