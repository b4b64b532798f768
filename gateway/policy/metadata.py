"""Field metadata of the policy model: the reference text and the flags that loading,
the JSON Schema and showing a policy read.

Every field's ``metadata["doc"]`` is the reference text for ``docs/policy.md`` and the
JSON Schema.  A field marked ``keyed`` is written in YAML as a mapping from name to object
(``backends: {main: {...}}``) and held in the model as a tuple of objects whose ``name`` is
that key; a ``mapping`` field is a mapping of strings in YAML and a tuple of pairs here.
``secret`` fields are redacted wherever a policy is shown; ``env`` fields expand
``${NAME}`` from the environment and ``${file:/path}`` from a file (``convert.py``) at load
time.
"""

from __future__ import annotations

from typing import Any


def doc(text: str, **extra: Any) -> dict[str, Any]:
    """A field's metadata: its reference text, plus flags such as ``keyed="name"``."""
    return {"doc": text, **extra}
