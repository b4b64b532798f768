"""YAML policy files -> a validated ``Policy``, with every error located by file, key path
and line.

A policy is one YAML file or a directory of them (a Kubernetes ConfigMap volume: the
``..data`` symlink dance is invisible here because files are read through their names).
In a directory, files are read in name order, hidden files skipped; ``backends`` merge,
``routes`` concatenate in file order, and each other section may be set by one file only.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gateway.errors import PolicyError, Problem
from gateway.policy.checks import (
    check_admin,
    check_backend,
    check_retry_budget,
    check_route,
    check_server,
    check_throttle,
    check_tracing,
    warn_route,
    warn_throttle,
)
from gateway.policy.convert import Found, convert, join
from gateway.policy.hedge import warn_hedge
from gateway.policy.match import check_match
from gateway.policy.model import (
    Backend,
    CacheStore,
    Match,
    Policy,
    Route,
    Tenants,
    ThrottleRule,
)
from gateway.policy.rate_limit import warn_cost
from gateway.policy.redis import Redis, check_redis, effective
from gateway.policy.tenant_checks import check_tenants

POLICY_SUFFIXES = (".yaml", ".yml")
_SINGLETONS = (
    "server",
    "admin",
    "metrics",
    "cache",
    "retry_budget",
    "tracing",
    "tenants",
    "redis",
)
_SINGLETON_CHECKS: dict[str, Any] = {
    "server": check_server,
    "admin": check_admin,
    "retry_budget": check_retry_budget,
    "tracing": check_tracing,
    "tenants": check_tenants,
    "cache": lambda cache: (
        [] if cache.feedback_per_min > 0 else [("feedback_per_min", "must be greater than 0")]
    ),
}


@dataclass(frozen=True, slots=True)
class Loaded:
    """A policy with the digest of the text it came from and the files read."""

    policy: Policy
    digest: str
    files: tuple[str, ...]
    warnings: tuple[Problem, ...] = ()
    secret_files: tuple[str, ...] = ()
    """The ``${file:...}`` files its values were read from (watched with the policy)."""


@dataclass(slots=True)
class _Part:
    source: str
    policy: Policy | None
    lines: dict[str, int]
    keys: frozenset[str]
    unset: frozenset[str] = frozenset()
    secret_files: tuple[str, ...] = ()
    """Key paths whose ``${NAME}`` was unset (``lenient_env``): not checked further."""


def policy_files(path: Path) -> list[Path]:
    """The YAML files a policy path stands for, in the order they are merged."""
    if path.is_dir():
        return sorted(
            p
            for p in path.iterdir()
            if not p.name.startswith(".") and p.suffix in POLICY_SUFFIXES and p.is_file()
        )
    return [path]


def read_sources(path: str | Path) -> list[tuple[str, str]]:
    """(file name, text) of every file of a policy path; unreadable paths are PolicyErrors."""
    path = Path(path)
    if not path.exists():
        raise PolicyError([Problem(str(path), "", None, "no such file or directory")])
    files = policy_files(path)
    if not files:
        raise PolicyError([Problem(str(path), "", None, "no .yaml or .yml files in directory")])
    sources = []
    for f in files:
        try:
            sources.append((str(f), f.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError) as exc:
            raise PolicyError([Problem(str(f), "", None, f"cannot read: {exc}")]) from exc
    return sources


def load_policy(path: str | Path, *, lenient_env: bool = False) -> Loaded:
    """Read and validate the policy at ``path`` (a file or a directory).

    ``lenient_env`` turns unset ``${NAME}`` variables into warnings (for ``gateway check``
    where the secrets are absent)."""
    return parse_sources(read_sources(path), lenient_env=lenient_env)


def parse_policy_text(text: str, source: str = "<policy>") -> Policy:
    """Parse one YAML document into a Policy (raises PolicyError)."""
    return parse_sources([(source, text)]).policy


def parse_sources(sources: list[tuple[str, str]], *, lenient_env: bool = False) -> Loaded:
    """Validate and merge already-read policy texts."""
    digest = hashlib.sha256()
    parts: list[_Part] = []
    problems: list[Problem] = []
    warnings: list[Problem] = []
    for source, text in sources:
        digest.update(source.rsplit("/", 1)[-1].encode() + b"\0" + text.encode() + b"\0")
        parts.append(_parse_part(source, text, problems, warnings, lenient_env))
    if not problems:
        policy = _merge(parts, problems, warnings)
        if not problems:
            secret_files = tuple(dict.fromkeys(f for p in parts for f in p.secret_files))
            return Loaded(
                policy,
                digest.hexdigest()[:16],
                tuple(s for s, _ in sources),
                tuple(warnings),
                secret_files,
            )
    raise PolicyError(problems)


def _parse_part(
    source: str, text: str, problems: list[Problem], warnings: list[Problem], lenient_env: bool
) -> _Part:
    try:
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else {}
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problems.append(Problem(source, "", line, f"invalid YAML: {_yaml_reason(exc)}"))
        return _Part(source, None, {}, frozenset())
    lines: dict[str, int] = {}
    if node is not None:
        _record_lines(node, "", lines)
    if data is None:
        data = {}
    found = Found(lenient_env=lenient_env)
    policy = convert(Policy, data, "", found)
    problems.extend(Problem(source, p.path, _line_of(lines, p.path), p.message) for p in found)
    warnings.extend(
        Problem(source, p.path, _line_of(lines, p.path), p.message) for p in found.warnings
    )
    keys = frozenset(data) if isinstance(data, dict) else frozenset()
    unset = frozenset(p.path for p in found.warnings)
    return _Part(source, policy if not found else None, lines, keys, unset, tuple(found.files))


def _merge(parts: list[_Part], problems: list[Problem], warnings: list[Problem]) -> Policy:
    backends: dict[str, Backend] = {}
    routes: list[Route] = []
    where: list[tuple[_Part, str]] = []
    singles: dict[str, Any] = {}
    setters: dict[str, str] = {}
    throttles: list[tuple[ThrottleRule, _Part, str]] = []
    for part in parts:
        assert part.policy is not None  # parts with problems stop before merging
        for b in part.policy.backends:
            path = join("backends", b.name)
            if b.name in backends:
                problems.append(
                    Problem(
                        part.source,
                        path,
                        _line_of(part.lines, path),
                        f"backend {b.name!r} is defined in another file too",
                    )
                )
            backends[b.name] = b
            _report(check_backend(b), part, path, problems)
        for i, r in enumerate(part.policy.routes):
            routes.append(r)
            where.append((part, join("routes", i)))
            _report(warn_route(r), part, join("routes", i), warnings)
        for i, rule in enumerate(part.policy.throttle):
            throttles.append((rule, part, join("throttle", i)))
        for key in _SINGLETONS:
            if key in part.keys:
                if key in setters:
                    problems.append(
                        Problem(
                            part.source,
                            key,
                            _line_of(part.lines, key),
                            f"{key!r} is already set in {setters[key]}",
                        )
                    )
                setters[key] = part.source
                singles[key] = getattr(part.policy, key)
    keys = singles["tenants"].keys if "tenants" in singles else ()
    named = _name_routes(routes, where, backends, {k.name for k in keys}, problems)
    for r, (part, path) in zip(routes, where, strict=True):
        hedge = backends[r.backend].hedge if r.backend in backends else None
        _report(warn_hedge(hedge, r.match.path), part, path, warnings)
        priced = any(backends[b].price for b in (r.backend, *r.fallback) if b in backends)
        bounded = r.generation is not None and r.generation.bounds_tokens
        _report(warn_cost(r.rate_limit, priced, bounded), part, path, warnings)
    seen: set[tuple[str, str]] = set()
    for rule, part, path in throttles:
        _report(check_throttle(rule, backends), part, path, problems)
        _report(warn_throttle(rule, backends), part, path, warnings)
        if (rule.name, rule.backend) in seen:
            message = f"rule {rule.name!r} is defined twice for backend {rule.backend!r}"
            _report([("name", message)], part, path, problems)
        seen.add((rule.name, rule.backend))
    for key, check in _SINGLETON_CHECKS.items():
        setter = next((p for p in parts if key in p.keys), None)
        if setter is not None:
            _report(check(singles[key]), setter, key, problems)
    tenants = next((p for p in parts if "tenants" in p.keys), None)
    if tenants is not None and "tenants.response_id_secret" not in tenants.unset:
        _report(_open_ids(singles["tenants"]), tenants, "tenants", warnings)
    _merge_redis(parts, singles, problems)
    return Policy(
        backends=tuple(backends.values()),
        routes=tuple(named),
        throttle=tuple(t for t, _, _ in throttles),
        **singles,
    )


def _open_ids(tenants: Tenants) -> list[tuple[str, str]]:
    """Tenants named with no ``response_id_secret``: their stored objects lie open to each
    other (a warning, not an error: a backend may store nothing)."""
    if not tenants.keys or tenants.response_id_secret:
        return []
    return [
        (
            "response_id_secret",
            "is not set, so a backend that stores responses, conversations or chat "
            "completions serves each to any tenant that names its id: set it (16 characters "
            "or more, the same in every replica) unless the backends store nothing",
        )
    ]


def _merge_redis(parts: list[_Part], singles: dict[str, Any], problems: list[Problem]) -> None:
    """Check ``redis:`` and fold its alias ``cache.redis_url`` into it."""
    cache: CacheStore = singles.get("cache", CacheStore())
    alias = any("cache.redis_url" in p.lines for p in parts if "cache" in p.keys)
    redis_part = next((p for p in parts if "redis" in p.keys), None)
    if redis_part is not None:
        _report(check_redis(singles["redis"], alias), redis_part, "redis", problems)
    singles["redis"] = effective(singles.get("redis", Redis()), cache.redis_url)


def _report(found: list[tuple[str, str]], part: _Part, path: str, problems: list[Problem]) -> None:
    for key, message in found:
        p = join(path, key) if key else path
        if p not in part.unset:
            problems.append(Problem(part.source, p, _line_of(part.lines, p), message))


def _name_routes(
    routes: list[Route],
    where: list[tuple[_Part, str]],
    backends: dict[str, Backend],
    tenants: set[str],
    problems: list[Problem],
) -> list[Route]:
    named: list[Route] = []
    seen: set[str] = set()
    for route, (part, path) in zip(routes, where, strict=True):
        if route.backend not in backends:
            p = join(path, "backend")
            known = ", ".join(sorted(backends)) or "none defined"
            problems.append(
                Problem(
                    part.source,
                    p,
                    _line_of(part.lines, p),
                    f"unknown backend {route.backend!r} (known: {known})",
                )
            )
        _report(check_match(route.match, tenants), part, path, problems)
        _report(check_route(route, backends), part, path, problems)
        name = route.name or _default_name(route.match)
        if name in seen:
            if route.name:
                p = join(path, "name")
                problems.append(
                    Problem(
                        part.source,
                        p,
                        _line_of(part.lines, p),
                        f"route name {name!r} is used twice",
                    )
                )
            else:
                suffix = 2
                while f"{name}#{suffix}" in seen:
                    suffix += 1
                name = f"{name}#{suffix}"
        seen.add(name)
        named.append(dataclasses.replace(route, name=name))
    return named


def _default_name(match: Match) -> str:
    return match.path + (f" model={match.model}" if match.model else "")


def zero_config_policy(url: str) -> Policy:
    """The policy of ``gateway serve --upstream URL``: one backend, every path proxied."""
    text = yaml.safe_dump(
        {
            "backends": {"upstream": {"url": url}},
            "routes": [{"match": {"path": "*"}, "backend": "upstream", "name": "default"}],
        }
    )
    return parse_policy_text(text, "--upstream")


def _record_lines(node: yaml.Node, path: str, lines: dict[str, int]) -> None:
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            child = join(path, str(key_node.value))
            lines[child] = key_node.start_mark.line + 1
            _record_lines(value_node, child, lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _record_lines(item, join(path, i), lines)


def _line_of(lines: dict[str, int], path: str) -> int | None:
    while path:
        if path in lines:
            return lines[path]
        cut = max(path.rfind("."), path.rfind("["))
        path = path[:cut] if cut > 0 else ""
    return lines.get("")


def _yaml_reason(exc: yaml.YAMLError) -> str:
    problem = getattr(exc, "problem", None)
    return str(problem) if problem else str(exc).splitlines()[0]
