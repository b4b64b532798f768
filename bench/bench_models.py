"""What the OpenAI-shape capabilities cost: one model list over several backends (a route's
``merge_models``), the model a backend is asked for (``target_models``) and a stream's
usage asked for where its client did not (``stream_usage: ask``).

    python -m bench.bench_models [--duration 5] [--rounds 3]

Two model servers (``gateway sim``, one listing chat models, the other embedders, both
answering at once: no simulated GPU time) and the gateway before them, on one machine.
Every path is asked by wrk, the paths taking turns in each round; latency at 1 connection,
requests/s at 16; each figure the median over the rounds.

- ``GET /v1/models``: one server directly, the gateway passing one server's list through
  (a route without ``merge_models``), and the gateway merging both lists (two upstream
  calls, two JSON reads and one JSON write where the pass-through costs one call and no
  parse).
- ``POST /v1/chat/completions`` (a small body): the server directly, the gateway passing
  the body through, and the gateway rewriting its ``model`` (``target_models``, two targets
  by weight: the body parsed, as always, then written again).
- The same streamed: the server directly, the gateway passing the stream through, and a
  route with ``stream_usage: ask`` (the usage chunk asked for, counted and taken out).
- ``POST /v1/responses`` (OpenAI's Responses API) and ``POST /v1/messages`` (Anthropic's),
  small bodies: the server directly and through the gateway, which reads them as it reads
  chat (parsed, routed on ``model``, their usage counted); the Responses API through a
  gateway that binds its ids to the tenant (``tenants.response_id_secret``); a continuation
  (``previous_response_id``) of a stored response, directly and through that gateway to a
  backend of two instances, where each continuation is pinned to the instance that holds
  the response its id names; a conversation (the Conversations API) read directly and
  through that gateway, pinned alike; a Responses API answer the server does not store
  (``store: false``) at temperature 0, from the cache; a chat completion asked to be
  stored (``store: true``), its id bound, against the same route's chat not stored;
  Anthropic's at temperature 0 on a caching route, whole and streamed: every request after
  the first a hit (a stream replayed byte for byte); and a file (the Files API) read by its
  id, and a chat naming it in a ``file`` part, directly and through the binding gateway.

Writes docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import httpx
import yaml

from bench.common import free_port, have, machine, process, python, update_section, wrk

CHAT_MODELS = "llama-3.1-8b,llama-3.1-70b,qwen2.5-7b"
EMBEDDER_MODELS = "bge-small-en,e5-large"
CHAT = '{"model":"assistant","messages":[{"role":"user","content":"hello there"}]}'
STORED_CHAT = CHAT[:-1] + ',"store":true}'
LIST_PATHS = ("direct (one server)", "gateway, one server's list", "gateway, two lists merged")
CHAT_PATHS = ("direct", "gateway, body passed through", "gateway, model rewritten")
STREAM = '{"model":"streamer","messages":[{"role":"user","content":"hello"}],"stream":true}'
ASKED = STREAM[:-1] + ',"stream_options":{"include_usage":true}}'
RESPONSES = '{"model":"assistant","input":"hello there","store":false}'
UNSTORED = '{"model":"unstored","input":"hello there","store":false,"temperature":0}'
PAIRED = '{"model":"paired","input":"hello there"}'
"""Stored: the response the continuations continue.  Nothing else the bench asks is stored,
so the servers' stores (the last 4096 responses) keep it."""
MESSAGES = (
    '{"model":"assistant","max_tokens":4,"messages":[{"role":"user","content":"hello there"}]}'
)
CACHED = MESSAGES[:-1] + ',"temperature":0}'
FILE_CHAT = (
    '{"model":"assistant","messages":[{"role":"user","content":[{"type":"text","text":'
    '"hello there"},{"type":"file","file":{"file_id":"%s"}}]}]}'
)
CACHED_STREAM = CACHED[:-1] + ',"stream":true}'
OTHER_PATHS = (
    "direct, Responses API",
    "gateway, Responses API",
    "gateway, Responses API, ids bound to the tenant",
    "direct, Responses API continuation (previous_response_id)",
    "gateway, Responses API continuation, ids bound, pinned to one of two endpoints",
    "direct, Anthropic Messages",
    "gateway, Anthropic Messages",
    "gateway, Anthropic Messages at temperature 0, a cache hit",
    "direct, Anthropic Messages streamed",
    "gateway, Anthropic Messages streamed at temperature 0, a cache hit",
    "direct, a conversation read (Conversations API)",
    "gateway, a conversation read, ids bound, pinned to one of two endpoints",
    "gateway, Responses API not stored (store false) at temperature 0, a cache hit",
    "gateway, chat completion stored (store true), ids bound, model rewritten",
    "direct, a file read (Files API)",
    "gateway, a file read, ids bound",
    "direct, chat naming a file",
    "gateway, chat naming a file, ids bound, model rewritten",
)
STREAM_PATHS = (
    "direct, streamed",
    "direct, streamed with its usage asked",
    "gateway, stream passed through",
    "gateway, usage asked and taken out",
)


def sim(stack: ExitStack, models: str) -> str:
    port = free_port()
    args = python("-m", "gateway", "sim", "--port", str(port), "--models", models)
    args += ["--base-ms", "0", "--per-item-ms", "0", "--token-ms", "0", "--answer-tokens", "4"]
    stack.enter_context(process(args, port))
    return f"http://127.0.0.1:{port}"


def gateway(stack: ExitStack, tmp: Path, backends: dict[str, str], models: bool) -> str:
    """A gateway whose routes use the capabilities (``models``) or pass through."""
    listing: dict[str, object] = {"match": {"path": "/v1/models*"}, "backend": "chat"}
    chat: dict[str, object] = {"match": {"path": "/v1/chat/completions"}, "backend": "chat"}
    streams: dict[str, object] = {
        "match": {"path": "/v1/chat/completions", "model": "streamer"},
        "backend": "chat",
    }
    routes = [listing, streams, chat, {"match": {"path": "/v1/*"}, "backend": "chat"}]
    servers: dict[str, object] = {k: {"url": v} for k, v in backends.items()}
    if models:
        servers["pair"] = {"endpoints": list(backends.values()), "balance": "round_robin"}
        routes.insert(
            0, {"match": {"path": "/v1/responses*", "model": "paired"}, "backend": "pair"}
        )
        routes.insert(0, {"match": {"path": "/v1/conversations*"}, "backend": "pair"})
        unstored = {"path": "/v1/responses", "model": "unstored"}
        routes.insert(0, {"match": unstored, "backend": "chat", "cache": {"ttl_s": 3600}})
        cached = {"match": {"path": "/v1/messages"}, "backend": "chat", "cache": {"ttl_s": 3600}}
        routes.insert(0, cached)
        listing["merge_models"] = ["embedder"]
        targets = [{"model": "llama-3.1-8b", "weight": 9}, {"model": "qwen2.5-7b", "weight": 1}]
        chat["target_models"] = targets
        streams["stream_usage"] = "ask"
    policy = {
        "backends": servers,
        "routes": routes,
    }
    if models:
        policy["tenants"] = {"response_id_secret": "a-bench-secret-0123456789"}
    path = tmp / f"policy-{models}.yaml"
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    port, admin = free_port(), free_port()
    args = python("-m", "gateway", "serve", "--policy", str(path))
    args += ["--port", str(port), "--admin-port", str(admin)]
    stack.enter_context(process(args, port))
    return f"http://127.0.0.1:{port}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=int, default=5, help="seconds per wrk run")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the paths taking turns")
    args = parser.parse_args()
    if not have("wrk"):
        sys.exit("wrk is not installed (apt-get install wrk)")
    runs: dict[str, list[dict[str, float]]] = {}
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        backends = {"chat": sim(stack, CHAT_MODELS), "embedder": sim(stack, EMBEDDER_MODELS)}
        plain = gateway(stack, Path(tmp), backends, models=False)
        models = gateway(stack, Path(tmp), backends, models=True)
        script, streamed = Path(tmp) / "chat.lua", Path(tmp) / "stream.lua"
        asked = Path(tmp) / "asked.lua"
        responses, messages = Path(tmp) / "responses.lua", Path(tmp) / "messages.lua"
        cached, cached_stream = Path(tmp) / "cached.lua", Path(tmp) / "cached-stream.lua"
        bodies = ((script, CHAT), (streamed, STREAM), (asked, ASKED), (cached, CACHED))
        for file, body in (
            *bodies,
            (responses, RESPONSES),
            (messages, MESSAGES),
            (cached_stream, CACHED_STREAM),
            (Path(tmp) / "unstored.lua", UNSTORED),
            (Path(tmp) / "stored-chat.lua", STORED_CHAT),
        ):
            file.write_text(
                f"wrk.method = 'POST'\nwrk.body = '{body}'\n"
                "wrk.headers['Content-Type'] = 'application/json'\n"
            )
        paths: dict[str, tuple[str, Path | None]] = {
            LIST_PATHS[0]: (backends["chat"] + "/v1/models", None),
            LIST_PATHS[1]: (plain + "/v1/models", None),
            LIST_PATHS[2]: (models + "/v1/models", None),
            CHAT_PATHS[0]: (backends["chat"] + "/v1/chat/completions", script),
            CHAT_PATHS[1]: (plain + "/v1/chat/completions", script),
            CHAT_PATHS[2]: (models + "/v1/chat/completions", script),
            STREAM_PATHS[0]: (backends["chat"] + "/v1/chat/completions", streamed),
            STREAM_PATHS[1]: (backends["chat"] + "/v1/chat/completions", asked),
            STREAM_PATHS[2]: (plain + "/v1/chat/completions", streamed),
            STREAM_PATHS[3]: (models + "/v1/chat/completions", streamed),
            OTHER_PATHS[0]: (backends["chat"] + "/v1/responses", responses),
            OTHER_PATHS[1]: (plain + "/v1/responses", responses),
            OTHER_PATHS[2]: (models + "/v1/responses", responses),
            OTHER_PATHS[3]: (backends["chat"] + "/v1/responses", Path(tmp) / "direct.lua"),
            OTHER_PATHS[4]: (models + "/v1/responses", Path(tmp) / "pinned.lua"),
            OTHER_PATHS[5]: (backends["chat"] + "/v1/messages", messages),
            OTHER_PATHS[6]: (plain + "/v1/messages", messages),
            OTHER_PATHS[7]: (models + "/v1/messages", cached),
            OTHER_PATHS[8]: (backends["chat"] + "/v1/messages", cached_stream),
            OTHER_PATHS[9]: (models + "/v1/messages", cached_stream),
            OTHER_PATHS[12]: (models + "/v1/responses", Path(tmp) / "unstored.lua"),
            OTHER_PATHS[13]: (models + "/v1/chat/completions", Path(tmp) / "stored-chat.lua"),
        }
        for at, base in ((10, backends["chat"]), (11, models)):
            made = httpx.post(base + "/v1/conversations", json={}).json()["id"]
            paths[OTHER_PATHS[at]] = (f"{base}/v1/conversations/{made}", None)
            assert httpx.get(paths[OTHER_PATHS[at]][0]).json()["id"] == made
        merged = httpx.get(models + "/v1/models").json()["data"]
        assert len(merged) == 5, merged
        rewritten = httpx.post(models + "/v1/chat/completions", content=CHAT).headers
        assert rewritten["x-gateway-model"] in ("llama-3.1-8b", "qwen2.5-7b"), rewritten
        kept = httpx.post(models + "/v1/chat/completions", content=STREAM).content
        assert b"[DONE]" in kept and b"completion_tokens" not in kept, kept
        for path, body in (("/v1/responses", RESPONSES), ("/v1/messages", MESSAGES)):
            read = httpx.post(plain + path, content=body)
            assert read.status_code == 200 and read.json()["usage"], read.text
        bound = httpx.post(models + "/v1/responses", content=RESPONSES).json()["id"]
        assert "~" in bound, bound
        stored = httpx.post(models + "/v1/chat/completions", content=STORED_CHAT).json()["id"]
        assert "~" in stored, stored
        for name, base in (("direct", backends["chat"]), ("pinned", models)):
            made = httpx.post(base + "/v1/responses", content=PAIRED).json()["id"]
            body = PAIRED[:-1] + f',"previous_response_id":"{made}","store":false}}'
            assert httpx.post(base + "/v1/responses", content=body).status_code == 200
            (Path(tmp) / f"{name}.lua").write_text(
                f"wrk.method = 'POST'\nwrk.body = '{body}'\n"
                "wrk.headers['Content-Type'] = 'application/json'\n"
            )
        for at, base in ((14, backends["chat"]), (16, models)):
            form = {"file": ("notes.txt", b"hello there")}
            fid = httpx.post(base + "/v1/files", files=form, data={"purpose": "user_data"})
            made = fid.json()["id"]
            assert ("~" in made) == (base == models), made
            paths[OTHER_PATHS[at]] = (f"{base}/v1/files/{made}", None)
            named_lua = Path(tmp) / f"file-chat-{at}.lua"
            named_lua.write_text(
                f"wrk.method = 'POST'\nwrk.body = '{FILE_CHAT % made}'\n"
                "wrk.headers['Content-Type'] = 'application/json'\n"
            )
            paths[OTHER_PATHS[at + 1]] = (base + "/v1/chat/completions", named_lua)
            named = httpx.post(base + "/v1/chat/completions", content=FILE_CHAT % made)
            assert named.status_code == 200, named.text
        for body in (CACHED, CACHED, CACHED_STREAM, CACHED_STREAM):
            hit = httpx.post(models + "/v1/messages", content=body).headers["x-gateway-cache"]
        assert hit == "hit", hit
        for _ in range(2):
            hit = httpx.post(models + "/v1/responses", content=UNSTORED).headers["x-gateway-cache"]
        assert hit == "hit", hit
        for url, lua in paths.values():  # warm: pools, imports
            wrk(url, connections=4, duration_s=1, script=lua)
        for _ in range(args.rounds):
            for name, (url, lua) in paths.items():
                one = wrk(url, connections=1, duration_s=args.duration, script=lua)
                many = wrk(url, connections=16, duration_s=args.duration, script=lua)
                runs.setdefault(name, []).append(
                    {
                        "p50": one["p50_ms"],
                        "p99": one["p99_ms"],
                        "rps": many["rps"],
                        "errors": one["errors"] + many["errors"],
                    }
                )
    update_section("models", report(runs, args))


def report(runs: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> str:
    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    def table(names: tuple[str, ...]) -> list[str]:
        rows = [
            "| path | p50 ms (1 conn) | p99 ms (1 conn) | req/s (16 conn) | non-2xx |",
            "|---|---|---|---|---|",
        ]
        for name in names:
            rows.append(
                f"| {name} | {median(name, 'p50'):.3f} | {median(name, 'p99'):.3f} | "
                f"{median(name, 'rps'):.0f} | {sum(r['errors'] for r in runs[name]):.0f} |"
            )
        return rows

    def cost(plain: str, changed: str) -> str:
        added = median(changed, "p50") - median(plain, "p50")
        ratio = median(changed, "rps") / median(plain, "rps")
        return f"{added:+.3f} ms at p50 and {ratio:.2f}x the requests per second"

    return "\n".join(
        [
            "## Model lists, target models, stream usage, other APIs (`merge_models`, "
            "`target_models`, `stream_usage`, `/v1/responses`, `/v1/messages`)",
            "",
            f"`python -m bench.bench_models --duration {args.duration} --rounds "
            f"{args.rounds}` on {machine()}. Two `gateway sim` servers (3 chat models, 2 "
            "embedders, answering at once), two gateways (routes passing through, and routes "
            "with `merge_models` and `target_models`) and wrk share the machine; latency at 1 "
            "connection, throughput at 16, medians over the rounds, the paths taking turns.",
            "",
            "`GET /v1/models`:",
            "",
            *table(LIST_PATHS),
            "",
            "`POST /v1/chat/completions`, a small body whose `model` the policy rewrites "
            "(two targets by weight):",
            "",
            *table(CHAT_PATHS),
            "",
            'The same, streamed (`"stream":true`, 4 tokens), on a route with `stream_usage: '
            "ask` (the usage chunk asked for, counted and taken out of the stream):",
            "",
            *table(STREAM_PATHS),
            "",
            "`POST /v1/responses` and `POST /v1/messages` (small bodies), read as chat is:",
            "",
            *table(OTHER_PATHS),
            "",
            f"Merging two lists costs {cost(LIST_PATHS[1], LIST_PATHS[2])} of the gateway's "
            "pass-through of one (the two servers are asked at once; two upstream calls and "
            f"their JSON per request). Rewriting the model costs "
            f"{cost(CHAT_PATHS[1], CHAT_PATHS[2])} of the pass-through (the body written "
            "again, a draw, a header and a counter). Asking a stream's usage and taking it "
            f"out costs {cost(STREAM_PATHS[2], STREAM_PATHS[3])} of the pass-through (the "
            "body written again, the stream framed into events, and the server's own work "
            "for the usage: asked directly, the server costs "
            f"{cost(STREAM_PATHS[0], STREAM_PATHS[1])} of its stream without it). Through "
            f"the gateway, the Responses API costs {cost(OTHER_PATHS[0], OTHER_PATHS[1])} "
            f"of the server asked directly, Anthropic's Messages API "
            f"{cost(OTHER_PATHS[5], OTHER_PATHS[6])}, and chat (the same parse) "
            f"{cost(CHAT_PATHS[0], CHAT_PATHS[1])}. Binding the Responses API's ids to the "
            "tenant (`tenants.response_id_secret`: the answer asked for uncompressed and "
            "read for the id the server gave it and its output items' ids, each tagged by "
            "HMAC) costs "
            f"{cost(OTHER_PATHS[1], OTHER_PATHS[2])} of the "
            "gateway without it. A continuation through that gateway (its id's tag checked, "
            "the id taken off, the body written again, the request pinned to the endpoint "
            "the id names, the new id tagged) costs "
            f"{cost(OTHER_PATHS[3], OTHER_PATHS[4])} of a continuation asked of the server "
            "directly, and a conversation's read through it (the Conversations API: the same "
            f"check, pin and tag) {cost(OTHER_PATHS[10], OTHER_PATHS[11])} of the read asked "
            "directly. An Anthropic answer at temperature 0 from the cache (the "
            "exact tier in memory; the server is not asked) gives "
            f"{cost(OTHER_PATHS[5], OTHER_PATHS[7])} of the server asked directly, and a "
            "stream replayed byte for byte "
            f"{cost(OTHER_PATHS[8], OTHER_PATHS[9])} of the server's stream (a simulated "
            "server that answers at once: a real model's answer takes milliseconds to "
            "seconds, which a hit saves). A Responses API answer the server does not store "
            "(`store: false`, temperature 0) from the cache gives "
            f"{cost(OTHER_PATHS[0], OTHER_PATHS[12])} of the server asked directly. A chat "
            "completion asked to be stored (`store: true`, OpenAI's stored completions) has "
            "its id bound there too (the answer read for it, which is tagged): "
            f"{cost(CHAT_PATHS[2], OTHER_PATHS[13])} of the same route's chat not stored. "
            "With files bound (`gateway/openai/file_ids.py`), a file read by its id (the "
            "tag checked, the request pinned, the answer read and its id tagged) costs "
            f"{cost(OTHER_PATHS[14], OTHER_PATHS[15])} of the read asked directly, and a "
            "chat naming a file (its body read for the id, untagged, written again, and the "
            f"answer read for it) {cost(CHAT_PATHS[2], OTHER_PATHS[17])} of the same "
            "route's chat naming none.",
        ]
    )


if __name__ == "__main__":
    main()
