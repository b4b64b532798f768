"""A replica that does not serve its calls (``backends.<name>.endpoint_retries``): what its
clients see while one of three model servers is loading its model.

    python -m bench.bench_endpoint_retries [--duration 10] [--rounds 3] [--connections 8]

Three model servers answer a chat completion in ``SERVICE_MS``; one of them is restarting
and answers every call as llama.cpp's server does while it loads its weights (``503
Loading model``, at once) for the whole run, as a large model's load lasts minutes.  Clients
send chat completions over keep-alive connections, each answered before the next.  The
paths, taking turns in each round:

- direct: each client connection to one server, in turn (what a Service's round robin
  does);
- the gateway (a process of its own) over the three as endpoints, ``endpoint_retries: 0``:
  only the refusing replica left out for a second after each 503;
- the same with the default ``endpoint_retries: 2``: the call it refused goes to another.

Each row gives answers a second, the calls that failed (any status but 200) per 1,000, the
latency of the answered ones, and upstream calls per 100 answers.
"""

from __future__ import annotations

from typing import Any

from bench.common import machine, update_section
from bench.plumbing import (
    ANSWERS_S,
    CALLS_PER_100,
    CHAT,
    P50_MS,
    P99_MS,
    Answering,
    Load,
    closed_loop,
    figures_of,
    gateway,
    medians,
    rounds_command,
    rounds_of,
    run_rounds,
    serving,
)

SERVICE_MS = 4.0
BEFORE = (
    "2.3 calls in 1,000 failed (1,160 answers a second, p99 8.9 ms), as with `endpoint_retries: 0`"
)
"""The gateway's ``/completion`` row on the code of 86e5148, this bench's command, the same day."""
LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}


def policy(urls: list[str], retries: int) -> dict[str, Any]:
    return {
        "backends": {"fleet": {"endpoints": urls, "endpoint_retries": retries}},
        "routes": [{"match": {"path": "*"}, "backend": "fleet", "coalesce": False}],
    }


def loading(path: str, body: dict[str, Any]) -> Load:
    """Closed-loop calls to ``path``, with the calls that failed per 1,000."""

    async def load(urls: list[str], duration_s: float, connections: int) -> dict[str, float]:
        latencies, elapsed, failed = await closed_loop(
            urls, path, lambda: body, duration_s, connections
        )
        figures = figures_of(latencies, elapsed)
        figures["failed"] = 1000 * failed / max(1, failed + len(latencies))
        return figures

    return load


CHAT_LOAD = loading("/v1/chat/completions", CHAT)
NATIVE_LOAD = loading("/completion", {"prompt": "Hello", "n_predict": 8})


async def main(duration_s: float, rounds: int, connections: int) -> list[str]:
    refusing = Answering(0, LOADING, status=503)  # at once, as a server loading its weights
    replicas = [Answering(SERVICE_MS), refusing, Answering(SERVICE_MS)]
    async with serving(*(r.app() for r in replicas)) as urls:
        async with (
            gateway(policy(urls, 0)) as without,
            gateway(policy(urls, 2)) as retrying,
        ):
            paths = {
                "direct, each connection to one server": urls,
                "gateway, `endpoint_retries: 0`": [without],
                "gateway, `endpoint_retries: 2` (the default)": [retrying],
            }
            natives = {
                "direct, llama.cpp's own `/completion`": urls,
                "gateway, `endpoint_retries: 2`, llama.cpp's own `/completion`": [retrying],
            }
            for target in (without, retrying):  # connections made
                await CHAT_LOAD([target], 0.5, connections)
            calls = lambda: sum(r.calls for r in replicas)  # noqa: E731
            runs = await rounds_of(paths, CHAT_LOAD, calls, duration_s, rounds, connections)
            runs |= await rounds_of(natives, NATIVE_LOAD, calls, duration_s, rounds, connections)
    return medians(runs, COLUMNS)


COLUMNS = (
    ANSWERS_S,
    ("failed per 1,000 calls", "failed", ".1f"),
    P50_MS,
    P99_MS,
    CALLS_PER_100,
)


if __name__ == "__main__":
    args, lines = run_rounds(__doc__, 10.0, 8, main)
    update_section(
        "endpoint_retries",
        "## A replica loading its model (`backends.<name>.endpoint_retries`)\n\n"
        f"`{rounds_command('bench_endpoint_retries', args)}` on {machine()}. Three model "
        f"servers answer a chat completion in {SERVICE_MS:g} ms; one of them answers every "
        "call `503 Loading model` at once, as llama.cpp's server does while its weights "
        f"load, for the whole run. {args.connections} connections send chat completions, "
        "each answered before the next; the gateway runs as a process of its own, "
        "`least_request`. Each figure is the median over the rounds, in which the paths "
        "take turns (the chat paths, then llama.cpp's own). Before the servers' own "
        "inference calls counted as calls that change nothing (the code of 86e5148), on "
        f"the gateway's `/completion` row {BEFORE}.\n\n" + "\n".join(lines),
    )
