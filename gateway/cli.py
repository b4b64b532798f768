"""The ``gateway`` command: the only place that parses argv.

gateway serve --policy PATH | --upstream URL [--host --port --admin-host --admin-port]
              [--workers N|auto]
gateway check PATH...      validate policies; non-zero exit naming file, key path, line
gateway schema [--markdown] the policy's JSON Schema (or its reference page)
gateway metrics [--markdown] every metric family as JSON (or docs/metrics.md)
gateway sim [flags]        the simulated GPU model server
gateway demo [--backend sim|llama] [--duration S --clients N --json]  the before/after demo
gateway cache-eval PAIRS.tsv... [--embedding] [--plot F.png] [--json] [--adjudicated F.tsv]
                           precision / recall / false hits per cache tier, and curves
gateway cache-eval --calibrate PAIRS.tsv [--max-false-hit-rate R]
                           the learned verifier's operating point for your own pairs
gateway cache-eval --judge PAIRS.tsv [--judge-url URL]  the backend as judge, measured
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway import __version__
from gateway.errors import PolicyError

log = logging.getLogger("gateway")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    several = getattr(args, "worker", None) or getattr(args, "workers", 1) > 1
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s"
        + ("[%(process)d]" if several else "")
        + ": %(message)s",
    )
    result: int = args.run(args)
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway", description="Inference gateway sidecar.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    sub = parser.add_subparsers(dest="command")

    serve = sub.add_parser("serve", help="run the gateway")
    source = serve.add_mutually_exclusive_group(required=True)
    source.add_argument("--policy", help="policy YAML file or directory (hot-reloaded)")
    source.add_argument("--upstream", help="zero-config: proxy every path to this URL")
    serve.add_argument("--host", default="127.0.0.1", help="data-plane bind address")
    serve.add_argument("--port", type=int, default=8080, help="data-plane port")
    serve.add_argument("--admin-host", default=None, help="admin bind address (default: --host)")
    serve.add_argument("--admin-port", type=int, default=9090, help="admin port")
    serve.add_argument(
        "--access-log", action="store_true", help="one JSON line per request on stderr"
    )
    serve.add_argument(
        "--workers",
        type=_workers,
        default=1,
        help="worker processes sharing the data port (SO_REUSEPORT) under one supervisor "
        "that serves the admin port; auto: the CPUs the container may use (default: 1)",
    )
    serve.add_argument("--worker", metavar="SOCKET", help=argparse.SUPPRESS)  # a supervisor's
    serve.set_defaults(run=_serve)

    check = sub.add_parser("check", help="validate policy files or directories")
    check.add_argument("paths", nargs="+")
    check.set_defaults(run=_check)

    schema = sub.add_parser("schema", help="print the policy JSON Schema")
    schema.add_argument("--markdown", action="store_true", help="the reference page instead")
    schema.set_defaults(run=_schema)

    metrics = sub.add_parser("metrics", help="every metric: name, type, labels, meaning")
    metrics.add_argument("--markdown", action="store_true", help="the reference page instead")
    metrics.set_defaults(run=_metrics)

    demo = sub.add_parser("demo", help="simulated GPU + workload: before/after table")
    demo.add_argument("--backend", choices=("sim", "llama"), help="sim, or llama: a real model")
    demo.add_argument("--duration", type=float, help="seconds per phase (8; llama 30)")
    demo.add_argument("--clients", type=int, help="concurrent clients (32; llama 6)")
    demo.add_argument("--json", action="store_true", help="machine-readable output")
    demo.set_defaults(run=_demo)

    cache_eval = sub.add_parser(
        "cache-eval", help="precision, recall and false-hit rate of each cache tier and setting"
    )
    cache_eval.add_argument(
        "pairs", nargs="*", metavar="PAIRS.tsv", help="label<TAB>first<TAB>second per line"
    )
    cache_eval.add_argument("--json", action="store_true", help="machine-readable output")
    cache_eval.add_argument(
        "--embedding",
        action="store_true",
        help="also evaluate the embedding tier with the local model (the embedding extra)",
    )
    cache_eval.add_argument(
        "--calibrate",
        metavar="PAIRS.tsv",
        help="your own labelled pairs: print the learned verifier's operating point for "
        "--max-false-hit-rate on them and a policy snippet",
    )
    cache_eval.add_argument(
        "--max-false-hit-rate",
        type=float,
        default=None,
        help="the error budget for --calibrate (default: the policy's default)",
    )
    cache_eval.add_argument(
        "--plot", metavar="FILE.png", help="draw the precision-recall curves (needs matplotlib)"
    )
    cache_eval.add_argument(
        "--adjudicated", metavar="FILE.tsv", help="pairs labelled 0 judged the same question"
    )
    cache_eval.add_argument(
        "--judge", action="store_true", help="the backend as judge's grey zone on PAIRS.tsv"
    )
    cache_eval.add_argument("--judge-url", help="--judge: ask this OpenAI-compatible server")
    cache_eval.add_argument("--judge-model", help="--judge: the model to name (default: none)")
    cache_eval.add_argument("--judge-limit", type=int, help="--judge: ask at most N pairs")
    cache_eval.add_argument("--judge-header", action="append", default=[], help="--judge: header")
    cache_eval.set_defaults(run=_cache_eval)

    from gateway.sim.config import SimConfig

    sim = sub.add_parser("sim", help="run the simulated GPU model server")
    _add_dataclass_flags(sim, SimConfig)
    sim.set_defaults(run=_sim)
    return parser


def _add_dataclass_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One ``--field-name`` flag per field of a config dataclass, typed by its default."""
    for f in dataclasses.fields(cls):
        default = f.default
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "") + f" (default: {default})"
        if isinstance(default, bool):
            parser.add_argument(
                flag,
                dest=f.name,
                default=default,
                action=argparse.BooleanOptionalAction,
                help=help_text,
            )
        else:
            parser.add_argument(
                flag, dest=f.name, default=default, type=type(default), help=help_text
            )


def _dataclass_from_args(cls: type, args: argparse.Namespace) -> Any:
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def _check(args: argparse.Namespace) -> int:
    from gateway.policy.load import load_policy

    failed = False
    for path in args.paths:
        try:
            loaded = load_policy(path, lenient_env=True)
        except PolicyError as exc:
            failed = True
            for problem in exc.problems:
                print(f"error: {problem}", file=sys.stderr)
            continue
        for warning in loaded.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        p = loaded.policy
        for note in _cache_warnings(p):
            print(f"warning: {path}: {note}", file=sys.stderr)
        print(
            f"ok: {path} ({len(p.backends)} backends, {len(p.routes)} routes, hash {loaded.digest})"
        )
    return 1 if failed else 0


def _cache_warnings(policy: Any) -> list[str]:
    """What a valid policy asks of the cache that this installation cannot give."""
    from gateway.cache.embedding_seam import unavailable
    from gateway.cache.simhash import MAX_DISTANCE

    warnings = []
    for i, route in enumerate(policy.routes):
        if route.cache is None:
            continue
        semantic = route.cache.semantic
        where = f"routes[{i}].cache.semantic"
        if semantic.method == "embedding" and (reason := unavailable(semantic)):
            warnings.append(f"{where}.method: {reason}; the route serves exact and SimHash hits")
        if semantic.method != "off" and semantic.max_distance > MAX_DISTANCE:
            warnings.append(
                f"{where}.max_distance: {semantic.max_distance} is beyond what the SimHash "
                f"index finds; {MAX_DISTANCE} is used"
            )
    return warnings


def _cache_eval(args: argparse.Namespace) -> int:
    from gateway.cache.evaluate import evaluate, format_report, local_embed, read_adjudicated

    if not args.pairs and not args.calibrate:
        print("error: give PAIRS.tsv files, or --calibrate PAIRS.tsv", file=sys.stderr)
        return 2
    embed = None
    if args.embedding or args.calibrate or args.plot or args.judge:
        from gateway.cache.embedding import available

        ok, reason = available()
        if not ok:
            print(f"error: {reason}", file=sys.stderr)
            return 1
        embed = local_embed()
    if args.calibrate:
        return _calibrate(args.calibrate, embed, args.max_false_hit_rate, args.json)
    if args.judge:
        from gateway.cache.judge_eval import evaluate_judge, format_judge

        headers = [tuple(h.split(":", 1)) for h in args.judge_header if ":" in h]
        for path in args.pairs:
            report = evaluate_judge(
                path,
                local_embed(),
                url=args.judge_url,
                model=args.judge_model,
                headers=[(k.strip(), v.strip()) for k, v in headers],
                limit=args.judge_limit,
            )
            print(format_judge(report))
        return 0
    reports = []
    for path in args.pairs:
        try:
            judged = read_adjudicated(args.adjudicated) if args.adjudicated else None
            reports.append(evaluate(path, embed=embed, adjudicated=judged))
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    if args.json:
        data = [json.loads(r.to_json()) for r in reports]
        print(json.dumps(data[0] if len(data) == 1 else data, indent=2))
    else:
        print("\n\n".join(format_report(r) for r in reports))
    if args.plot:
        from gateway.cache.plot import plot

        try:
            plot(reports, args.plot)
        except ImportError:
            print("error: --plot needs matplotlib: pip install matplotlib", file=sys.stderr)
            return 1
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _calibrate(path: str, embed: Any, budget: float | None, as_json: bool) -> int:
    from gateway.cache.evaluate import calibrate_pairs
    from gateway.policy.route import DEFAULT_MAX_FALSE_HIT_RATE

    budget = DEFAULT_MAX_FALSE_HIT_RATE if budget is None else budget
    if not 0 < budget < 1:
        print("error: --max-false-hit-rate must be in (0, 1)", file=sys.stderr)
        return 2
    try:
        point, _ = calibrate_pairs(path, embed, budget)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    found = point.min_score <= 1
    if as_json:
        print(json.dumps({"source": path, "budget": budget, "found": found} | point.as_dict()))
        return 0 if found else 1
    if not found:
        print(
            f"{path}: no operating point keeps the false-hit rate's 95% upper bound within "
            f"{budget:g} ({point.negatives} pairs labelled different: too few, or the "
            "verifier confuses them); add labelled pairs or raise the budget",
            file=sys.stderr,
        )
        return 1
    print(
        f"{path}: {point.positives + point.negatives} pairs; at min_score {point.min_score:.3f}"
        f": recall {point.recall:.1%}, precision {point.precision or 0:.1%}, false-hit rate "
        f"{point.false_hit_rate:.2%} (95% upper bound {point.upper:.2%}, budget {budget:g})\n"
        "\n"
        "cache:\n"
        "  semantic:\n"
        "    method: embedding\n"
        "    verifier: learned\n"
        f"    min_score: {point.min_score:.3f}   # calibrated on {Path(path).name}"
    )
    return 0


def _schema(args: argparse.Namespace) -> int:
    from gateway.policy.schema import json_schema, reference_markdown

    if args.markdown:
        sys.stdout.write(reference_markdown())
    else:
        print(json.dumps(json_schema(), indent=2))
    return 0


def _metrics(args: argparse.Namespace) -> int:
    from gateway.metrics.reference import families, reference_markdown

    if args.markdown:
        sys.stdout.write(reference_markdown())
    else:
        print(json.dumps([dataclasses.asdict(f) for f in families()], indent=2))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from gateway.demo import DemoOptions, run_demo
    from gateway.demo.run import render

    options = DemoOptions.given(args.backend, args.duration, args.clients, args.json)
    if options.duration_s <= 0 or options.clients < 1:
        print("error: --duration must be > 0 and --clients >= 1", file=sys.stderr)
        return 2
    if args.log_level == "info":  # the demo's own table tells the story; keep logs to problems
        logging.getLogger().setLevel(logging.WARNING)
    if options.backend == "llama":
        from gateway.demo.llama import run_cli

        return run_cli(options, _run)
    if not args.json:
        print(
            "running the demo: the workload straight at a simulated GPU, then through the "
            f"gateway ({2 * options.duration_s:g} s), then the thermal scene (about 10 s) and "
            "the cold-start scene (about 8 s)...",
            file=sys.stderr,
            flush=True,
        )
    print(render(_run(run_demo(options)), args.json))
    return 0


def _sim(args: argparse.Namespace) -> int:
    from gateway.sim import SimConfig, run_sim

    try:
        config = _dataclass_from_args(SimConfig, args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _run(run_sim(config))
    return 0


def _workers(text: str) -> int:
    from gateway.workers.cpus import parse_workers

    try:
        return parse_workers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _serve(args: argparse.Namespace) -> int:
    from gateway.policy.load import zero_config_policy
    from gateway.policy.watch import PolicySource
    from gateway.serve import ServeOptions, serve

    try:
        source = (
            PolicySource(args.policy)
            if args.policy
            else PolicySource(fixed=zero_config_policy(args.upstream))
        )
        source.load()
    except PolicyError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 1
    source_args = ("--policy", args.policy) if args.policy else ("--upstream", args.upstream)
    worker_args = ("--log-level", args.log_level, "serve", *source_args, "--host", args.host)
    options = ServeOptions(
        args.host,
        args.port,
        args.admin_host,
        args.admin_port,
        args.access_log,
        args.workers,
        (*worker_args, *(("--access-log",) if args.access_log else ())),
        args.worker,
    )
    return int(_run(serve(options, source)))


def _run(coro: Any) -> Any:
    """Run a coroutine on uvloop where installed; its result."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it installs
        return asyncio.run(coro)
    return uvloop.run(coro)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
