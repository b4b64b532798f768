"""Names a package exports but imports only on first use (PEP 562).

A package whose ``__init__`` re-exports from heavy modules (numpy and its BLAS, an aiohttp
app) makes every process that touches any of its modules pay for all of them: the CLI
builds its flags from ``gateway.sim.config`` in every gateway process, and the cache stage
imports the embedding package whether a route uses it or not.  With
``__getattr__ = exports(__name__, {...})`` each name is imported from its module when first
asked for, and kept.

A name that is also a submodule's (``verify`` in ``verify.py``) cannot be lazy: importing
the submodule sets the package's attribute to the module, so such a name is imported
eagerly, as before.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def exports(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``homes`` maps each exported name to the
    submodule (relative to ``package``) that defines it."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{home}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
