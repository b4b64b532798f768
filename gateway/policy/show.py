"""A policy back to plain data, as ``GET /policy`` shows it, secrets redacted: fields
marked ``secret`` whole, and the credentials inside any URL (``user:password@``)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

REDACTED = "***"
_USERINFO = re.compile(r"(?<=://)[^/?#@]*@")


def redact_url(text: str) -> str:
    """``scheme://user:pass@host/...`` -> ``scheme://***@host/...``."""
    return _USERINFO.sub(REDACTED + "@", text) if "@" in text else text


def to_data(obj: Any, *, redact: bool = True) -> Any:
    """Plain JSON-able data in the policy file's own shape."""
    if isinstance(obj, str):
        return redact_url(obj) if redact else obj
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return obj
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        secret = redact and f.metadata.get("secret")
        if f.metadata.get("keyed"):
            key = f.metadata["keyed"]
            out[f.name] = {
                getattr(item, key): {
                    k: v for k, v in to_data(item, redact=redact).items() if k != key
                }
                for item in value
            }
        elif f.metadata.get("mapping"):
            out[f.name] = {k: (REDACTED if secret else to_data(v, redact=redact)) for k, v in value}
        elif isinstance(value, tuple):
            out[f.name] = [to_data(v, redact=redact) for v in value]
        elif secret and value is not None:
            out[f.name] = REDACTED
        else:
            out[f.name] = to_data(value, redact=redact)
    return out
