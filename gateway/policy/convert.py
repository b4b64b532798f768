"""Plain YAML data -> the frozen policy model, driven by the model's type hints.

One walk over the dataclasses both converts and validates: unknown keys, wrong types,
missing required keys and bad literals become ``Problem``s with the key path
(``routes[2].match.path``); the loader attaches file and line.  ``schema.py`` walks the same
hints to produce the JSON Schema, so the two cannot drift apart.

An ``env`` field expands ``${NAME}`` from the environment, and ``${file:/path}`` to a
file's text without its final line break: a Kubernetes Secret mounted as a volume, which
the kubelet updates in place (an environment variable never changes), so the policy
watcher reloads when it does (``Found.files``; ``watch.py``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from functools import cache
from typing import Any

_ENV = re.compile(r"\$\{(?:([A-Za-z_][A-Za-z0-9_]*)|file:([^}]*))\}")
MAX_SECRET_FILE_BYTES = 64 * 1024
"""A ``${file:...}`` at most: a secret, not a document."""
_MISSING = dataclasses.MISSING


class Found(list["Invalid"]):
    """The problems found by one conversion, and how ``${NAME}`` values are expanded.

    With ``lenient_env`` (``gateway check`` on a machine without the secrets) a missing
    variable or file is a warning and expands to an empty string; when serving it is an
    error.  ``files`` are the ``${file:...}`` files read.
    """

    def __init__(
        self, env: typing.Mapping[str, str] | None = None, lenient_env: bool = False
    ) -> None:
        super().__init__()
        self.env = os.environ if env is None else env
        self.lenient_env = lenient_env
        self.warnings: list[Invalid] = []
        self.files: list[str] = []


class Invalid(Exception):
    """Raised inside conversion; carries the key path and message."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path
        self.message = message


@cache
def hints(cls: type) -> dict[str, Any]:
    """Resolved type hints of a dataclass (cached: policies reload often)."""
    return typing.get_type_hints(cls)


def join(path: str, key: str | int) -> str:
    """Extend a key path: ``routes`` + 2 -> ``routes[2]``; ``a`` + ``b`` -> ``a.b``."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def type_name(tp: Any) -> str:
    """How a type is named in error messages."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return "any JSON value"
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (types.UnionType, typing.Union):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return "list"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return {
        str: "string",
        int: "integer",
        float: "number",
        bool: "boolean",
        type(None): "null",
    }.get(tp, str(tp))


def convert(
    tp: Any,
    value: Any,
    path: str,
    problems: Found,
    meta: typing.Mapping[str, Any] | None = None,
) -> Any:
    """Convert ``value`` to ``tp``; on error record a problem and return ``_MISSING``."""
    meta = meta or {}
    try:
        return _convert(tp, value, path, problems, meta)
    except Invalid as exc:
        problems.append(exc)
        return _MISSING


def _convert(
    tp: Any, value: Any, path: str, problems: Found, meta: typing.Mapping[str, Any]
) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, path, problems, meta)
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise Invalid(path, f"must be one of {type_name(tp)}, not {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return _dataclass(typing.cast(type, tp), value, path, problems)
    if origin is tuple:
        return _tuple(tp, value, path, problems, meta)
    return _scalar(tp, value, path, meta, problems)


def _scalar(tp: Any, value: Any, path: str, meta: typing.Mapping[str, Any], problems: Found) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(value):  # YAML's .nan and .inf: no figure means either
                raise Invalid(path, f"must be a finite number, not {value!r}")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            if meta.get("env"):
                return _expand(value, path, problems)
            literal = _ENV.search(value)
            if literal is not None:
                raise Invalid(path, f"{literal.group(0)} is not expanded in this key")
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
    else:  # pragma: no cover - the model uses only the types above
        raise TypeError(f"unsupported policy type {tp!r}")
    raise Invalid(path, f"must be a {type_name(tp)}, not {_describe(value)}")


def _tuple(
    tp: Any, value: Any, path: str, problems: Found, meta: typing.Mapping[str, Any]
) -> tuple[Any, ...]:
    (item_tp, _ellipsis) = typing.get_args(tp)
    if meta.get("mapping"):
        # tuple[tuple[str, str], ...] written in YAML as a mapping of strings
        if not isinstance(value, dict):
            raise Invalid(path, f"must be a mapping, not {_describe(value)}")
        out = []
        for key, item in value.items():
            v = convert(str, item, join(path, str(key)), problems, meta)
            out.append((str(key), v))
        return tuple(out)
    if meta.get("keyed"):
        if not isinstance(value, dict):
            raise Invalid(
                path, f"must be a mapping of name to {type_name(item_tp)}, not {_describe(value)}"
            )
        items = []
        for key, item in value.items():
            if not isinstance(item, dict):
                problems.append(
                    Invalid(join(path, str(key)), f"must be a mapping, not {_describe(item)}")
                )
                continue
            items.append(
                convert(item_tp, {meta["keyed"]: str(key), **item}, join(path, str(key)), problems)
            )
        return tuple(items)
    if value is None:
        return ()
    if not isinstance(value, list):
        raise Invalid(path, f"must be a list, not {_describe(value)}")
    return tuple(
        convert(item_tp, item, join(path, i), problems, meta) for i, item in enumerate(value)
    )


def _dataclass(cls: type, value: Any, path: str, problems: Found) -> Any:
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise Invalid(path, f"must be a mapping, not {_describe(value)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    type_hints = hints(cls)
    kwargs: dict[str, Any] = {}
    failed = False
    for key in value:
        if key not in fields:
            near = _closest(str(key), fields)
            hint = f" (did you mean {near!r}?)" if near else ""
            problems.append(Invalid(join(path, str(key)), f"unknown key{hint}"))
            failed = True
    for name, f in fields.items():
        if name in value:
            converted = convert(
                type_hints[name], value[name], join(path, name), problems, f.metadata
            )
            if converted is _MISSING:
                failed = True
            else:
                kwargs[name] = converted
        elif f.default is _MISSING and f.default_factory is _MISSING:
            problems.append(Invalid(join(path, name), "is required"))
            failed = True
        elif "required_unless" in f.metadata and not any(
            other in value for other in f.metadata["required_unless"]
        ):
            others = " or ".join(f"`{o}`" for o in f.metadata["required_unless"])
            problems.append(Invalid(join(path, name), f"is required (or {others})"))
            failed = True
    return _MISSING if failed else cls(**kwargs)


def _expand(text: str, path: str, found: Found) -> str:
    """Replace ``${NAME}`` with the environment variable NAME, ``${file:/path}`` with the
    file's text."""

    def sub(m: re.Match[str]) -> str:
        name, file = m.group(1), m.group(2)
        if file is not None:
            value, missing = _read_secret(file, path, found)
            where = "it must be readable where the gateway runs"
        elif name in found.env:
            return found.env[name]
        else:
            value, missing = None, f"environment variable {name} is not set"
            where = "it must be set where the gateway runs"
        if value is not None:
            return value
        if not found.lenient_env:
            raise Invalid(path, missing)
        found.warnings.append(Invalid(path, f"{missing} ({where})"))
        return ""

    return _ENV.sub(sub, text)


def secret_bytes(file: str) -> bytes:
    """A ``${file:...}``'s bytes, no more than a value may hold and one more (``OSError``
    when it cannot be read)."""
    with open(file, "rb") as handle:
        return handle.read(MAX_SECRET_FILE_BYTES + 1)


def _read_secret(file: str, path: str, found: Found) -> tuple[str | None, str]:
    """``file``'s text without its final line break (recorded in ``found.files``), or None
    and why not."""
    if not os.path.isabs(file):
        raise Invalid(path, f"${{file:{file}}}: the path must be absolute")
    found.files.append(file)
    try:
        data = secret_bytes(file)
    except OSError as exc:
        return None, f"file {file} cannot be read ({exc.strerror or exc})"
    if len(data) > MAX_SECRET_FILE_BYTES:
        return None, f"file {file} holds over {MAX_SECRET_FILE_BYTES} bytes: not a secret"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None, f"file {file} is not UTF-8 text"
    return text.removesuffix("\n").removesuffix("\r"), ""


def _closest(key: str, known: typing.Iterable[str]) -> str | None:
    import difflib

    matches = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return matches[0] if matches else None


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    name = {
        dict: "a mapping",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
    }.get(type(value))
    return (
        f"{name} ({value!r})"
        if name and not isinstance(value, dict | list)
        else (name or type(value).__name__)
    )


def walk_fields(cls: type) -> list[tuple[str, dataclasses.Field[Any], Any]]:
    """The fields of a dataclass with their resolved types, in order."""
    type_hints = hints(cls)
    return [(f.name, f, type_hints[f.name]) for f in dataclasses.fields(cls)]
