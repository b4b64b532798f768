"""The policy's JSON Schema and its reference page, both derived from the model's hints.

``gateway schema`` prints the schema (editors autocomplete YAML with it); ``docs/policy.md``
is ``reference_markdown()`` written out, and a test keeps the file in step with the code.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any

from gateway.policy.convert import walk_fields
from gateway.policy.model import Policy

SCHEMA_ID = "https://sidecar-gateway.dev/policy.schema.json"


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a policy file."""
    schema = _object_schema(Policy)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = SCHEMA_ID
    schema["title"] = "sidecar-gateway policy"
    return schema


def _object_schema(cls: type, skip: str | None = None) -> dict[str, Any]:
    props: dict[str, Any] = {}
    required: list[str] = []
    for name, f, tp in walk_fields(cls):
        if name == skip:
            continue
        prop = _type_schema(tp, f.metadata)
        prop["description"] = f.metadata.get("doc", "")
        default = _default(f)
        if default == [] and (f.metadata.get("keyed") or f.metadata.get("mapping")):
            default = {}
        if default is not dataclasses.MISSING and not dataclasses.is_dataclass(default):
            prop["default"] = default
        props[name] = prop
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(name)
    out: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if cls.__doc__:
        out["description"] = cls.__doc__.strip()
    if required:
        out["required"] = required
    return out


def _type_schema(tp: Any, meta: typing.Mapping[str, Any]) -> dict[str, Any]:
    origin = typing.get_origin(tp)
    if tp is Any:
        return {}
    if origin in (types.UnionType, typing.Union):
        inner = [_type_schema(a, meta) for a in typing.get_args(tp) if a is not type(None)]
        return {"anyOf": [*inner, {"type": "null"}]}
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(tp))}
    if dataclasses.is_dataclass(tp):
        return _object_schema(typing.cast(type, tp))
    if origin is tuple:
        item = typing.get_args(tp)[0]
        if meta.get("mapping"):
            return {"type": "object", "additionalProperties": {"type": "string"}}
        if meta.get("keyed"):
            return {
                "type": "object",
                "additionalProperties": _object_schema(item, skip=meta["keyed"]),
            }
        return {"type": "array", "items": _type_schema(item, {})}
    return {"type": {str: "string", int: "integer", float: "number", bool: "boolean"}[tp]}


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        value = f.default
        return list(value) if isinstance(value, tuple) else value
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def reference_markdown() -> str:
    """docs/policy.md: every key with its type, default and meaning."""
    lines = [
        "# Policy reference",
        "",
        "Generated from the policy model by `gateway schema --markdown`; "
        "`gateway schema` prints the same as JSON Schema.",
        "A policy is one YAML file or a directory of them (read in name order: `backends` "
        "merge, `routes` concatenate, every other section may be set in one file only). "
        "Unknown keys are errors. `gateway check PATH` validates a policy.",
        "A key whose meaning says it takes `${ENV}` also takes `${file:/path}`: the file's "
        "text without its final line break, such as a Kubernetes Secret mounted as a volume "
        "(at most 64 KiB). The policy reloads by itself when such a file changes, as when "
        "the kubelet rotates the Secret; an environment variable is read once, at start.",
        "",
    ]
    _section(Policy, "", lines)
    return "\n".join(lines) + "\n"


def _section(cls: type, prefix: str, lines: list[str]) -> None:
    title = f"`{prefix}`" if prefix else "Top level"
    lines += [
        f"## {title}",
        "",
        (cls.__doc__ or "").strip(),
        "",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
    ]
    nested: list[tuple[type, str]] = []
    for name, f, tp in walk_fields(cls):
        if name == "name" and prefix.endswith(".<name>"):
            continue
        default = _default(f)
        if default == [] and (f.metadata.get("keyed") or f.metadata.get("mapping")):
            default = {}
        shown = (
            "required"
            if default is dataclasses.MISSING
            else ("see below" if dataclasses.is_dataclass(default) else f"`{json.dumps(default)}`")
        )
        lines.append(
            f"| `{name}` | {_type_label(tp, f.metadata)} | {shown} | {f.metadata.get('doc', '')} |"
        )
        inner = _nested_class(tp)
        if inner is not None:
            suffix = (
                ".<name>"
                if f.metadata.get("keyed")
                else ("[]" if typing.get_origin(tp) is tuple else "")
            )
            nested.append((inner, f"{prefix + '.' if prefix else ''}{name}{suffix}"))
    lines.append("")
    for inner, path in nested:
        _section(inner, path, lines)


def _nested_class(tp: Any) -> type | None:
    if dataclasses.is_dataclass(tp):
        return typing.cast(type, tp)
    if typing.get_origin(tp) is tuple:
        item = typing.get_args(tp)[0]
        if dataclasses.is_dataclass(item):
            return typing.cast(type, item)
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        for arg in typing.get_args(tp):
            found = _nested_class(arg)
            if found is not None:
                return found
    return None


def _type_label(tp: Any, meta: typing.Mapping[str, Any]) -> str:
    origin = typing.get_origin(tp)
    if tp is Any:
        return "any"
    if origin in (types.UnionType, typing.Union):
        return " \\| ".join(_type_label(a, meta) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "mapping"
    if origin is tuple:
        if meta.get("mapping"):
            return "mapping of strings"
        if meta.get("keyed"):
            return "mapping of name to mapping"
        return "list"
    return {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}[tp]
