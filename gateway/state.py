"""Long-lived state that outlives policy reloads: batchers, caches, breakers, queues,
telemetry pollers.  Each piece belongs to a kind and a name (a backend or route) and is
kept while the settings that shaped it are unchanged; a reload that changes them gets a
fresh one and the old one is closed once it is no longer in use.

Kinds are typed (aiohttp's ``AppKey[T]`` is the model): ``GUARD: Kind[BackendGuard] =
Kind("guard")`` next to the class, and ``registry.peek(GUARD, "main")`` is a
``BackendGuard | None``, so nothing untyped crosses the registry.

A piece may have ``start()`` (called on the running loop when the gateway starts and after
each rebuild: pollers), ``drain()`` (shutdown has begun: stop queueing) and ``aclose()``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Kind(Generic[T]):
    """A kind of long-lived state, typed by what it holds."""

    name: str

    def __repr__(self) -> str:
        return f"<Kind {self.name}>"


class Registry:
    """State by (kind, name), rebuilt only when its settings change."""

    def __init__(self) -> None:
        self._items: dict[tuple[Kind[Any], str], tuple[Hashable, Any]] = {}
        self._used: set[tuple[Kind[Any], str]] = set()
        self._background: set[asyncio.Task[None]] = set()

    def get(self, kind: Kind[T], name: str, settings: Hashable, factory: Callable[[], T]) -> T:
        """The state for (kind, name); made by ``factory`` if absent or its settings
        differ (the replaced one is closed)."""
        key = (kind, name)
        self._used.add(key)
        found = self._items.get(key)
        if found is not None and found[0] == settings:
            return cast(T, found[1])
        if found is not None:
            self._close(found[1])
        item = factory()
        self._items[key] = (settings, item)
        return item

    def peek(self, kind: Kind[T], name: str = "") -> T | None:
        """The state for (kind, name) if it exists (for the admin and tests)."""
        found = self._items.get((kind, name))
        return cast(T, found[1]) if found is not None else None

    def begin(self) -> None:
        """Start a rebuild: ``end`` closes whatever the rebuild did not ``get``."""
        self._used = set()

    def end(self) -> None:
        for key in [k for k in self._items if k not in self._used]:
            self._close(self._items.pop(key)[1])

    def items(self, kind: Kind[T]) -> list[tuple[str, T]]:
        """(name, state) of every piece of ``kind``."""
        return [(name, cast(T, item)) for (k, name), (_, item) in self._items.items() if k == kind]

    def start(self) -> None:
        """On the running loop: start every piece that has ``start()`` (idempotent there)."""
        for _, item in list(self._items.values()):
            start = getattr(item, "start", None)
            if start is not None:
                start()

    def _close(self, item: Any) -> None:
        close = getattr(item, "aclose", None)
        if close is None:
            return
        try:
            task = asyncio.get_running_loop().create_task(close())
        except RuntimeError:  # no loop: nothing to close asynchronously
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def drain(self) -> None:
        """Shutdown has begun: every piece that queues work (``drain()``) stops queueing."""
        for _, item in list(self._items.values()):
            drain = getattr(item, "drain", None)
            if drain is not None:
                try:
                    drain()
                except Exception:
                    log.exception("draining %r failed", item)

    async def aclose(self) -> None:
        for _, item in list(self._items.values()):
            close = getattr(item, "aclose", None)
            if close is not None:
                try:
                    await close()
                except Exception:
                    log.exception("closing %r failed", item)
        self._items.clear()

    def __repr__(self) -> str:
        kinds: dict[str, int] = {}
        for kind, _ in self._items:
            kinds[kind.name] = kinds.get(kind.name, 0) + 1
        return f"<Registry {kinds}>"
