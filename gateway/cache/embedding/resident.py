"""``Resident``: a model loaded once per process, on its own thread, run on that thread;
``Once``: the process's one instance of a class.

The local embedder and the cross-encoder each keep one: the model loads off the event
loop (when ``start_loading()`` asks, on first use, or with ``await load()``), every run
happens on the same dedicated thread (onnxruntime releases the GIL while it computes), and
a load that failed is not retried: every later use raises its ``ImportError`` at once.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Resident(Generic[T]):
    """``factory()`` loaded at most once; ``await run(fn)`` calls ``fn(model)`` on the
    model's thread."""

    def __init__(self, factory: Callable[[], T], thread_name: str) -> None:
        self._factory = factory
        self._model: T | None = None
        self._failed: ImportError | None = None
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)

    async def run(self, fn: Callable[[T], R]) -> R:
        """``fn(model)`` on the model's thread (loading it there first if needed)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(self.model()))

    async def load(self) -> T:
        """Load the model now (off the event loop) rather than on first use."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.model)

    def start_loading(self) -> None:
        """Load the model in the background, without waiting (no event loop needed)."""
        self._executor.submit(self._load_quietly)

    def model(self) -> T:
        """The loaded model (loading it on the calling thread if needed)."""
        with self._lock:
            if self._failed is not None:
                raise self._failed
            if self._model is None:
                try:
                    self._model = self._factory()
                except ImportError as exc:
                    self._failed = exc
                    raise
            return self._model

    @property
    def state(self) -> str:
        if self._failed is not None:
            return "failed to load"
        return "loaded" if self._model is not None else "not loaded"

    def _load_quietly(self) -> None:
        try:
            self.model()
        except ImportError:
            pass  # raised again, and logged by its user, on first use


class Once(Generic[T]):
    """``once()``: the process's one ``factory()``, made on the first call (thread-safe)."""

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._made: T | None = None
        self._lock = threading.Lock()

    def __call__(self) -> T:
        with self._lock:
            if self._made is None:
                self._made = self._factory()
            return self._made
