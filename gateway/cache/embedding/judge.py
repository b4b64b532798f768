"""The backend as judge (opt-in): the route's own model confirms grey-zone paraphrases.

The embedding tier refuses a candidate whose learned score is below the route's
``min_score``.  Between that score and ``judge.min_score`` lies the *grey zone*: pairs the
verifier cannot call.  With ``cache.semantic.judge.enabled`` the tier hands the best
grey-zone candidate of a miss (a ``Pair``: the context, the asked message, the candidate's
stored message and entry) to the route's ``BackendJudge``, which, off the request path
(``mode: background``; ``mode: inline`` asks the same way, on the request's time, see
``decide``):

* keeps at most ``max_pending`` pairs waiting (one past it is dropped, counted) and sends
  at most ``rate_per_s`` calls a second, ``burst`` at once (a token bucket on the gateway's
  clock: a pair over the budget is counted ``rate_limited`` and not kept);
* asks the route's backend, through the gateway's upstream transport, one short chat
  completion (temperature 0, ``MAX_TOKENS``) with a fixed prompt, and takes only a clear
  "yes" for a yes (``parse``);
* on a yes files an *alias*: the asked message's normalised form, in that context, names
  the candidate's entry, so a repeat of the paraphrase finds that entry (the tier checks on
  every use that it is still stored, the same entry, of the same tenant and context);
* remembers each pair's verdict (bounded), so no pair is asked twice: a pair known to be
  the same is aliased again at once when it misses again (its entry expired and came back).

An error or a timeout is counted and remembered for nothing (the pair may be asked again,
within the budget), and pauses the judge for ``PAUSE_AFTER_ERROR_S``.  Pairs with a hard
difference (numbers, negations, quoted spans, code, word order, "my"/"your") never reach
the judge: the tier does not hand them over.  The aliases and verdicts live in this
process, like the memory store's entries.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

from gateway.clock import Clock
from gateway.errors import GatewayError, UpstreamError
from gateway.policy.model import Backend, Judge
from gateway.resilience.rate_limit import TokenBucket
from gateway.transport.upstream import Transport

log = logging.getLogger("gateway.cache")

JUDGE_PATH = "/v1/chat/completions"
MAX_TOKENS = 5
"""Room for "YES" or "NO" under any tokenizer, and nothing more."""
MAX_VERDICTS = 50_000
"""Pairs whose verdict is remembered, least recently asked first out."""
VERDICTS = ("yes", "no", "error", "dropped", "rate_limited", "paused")
"""What became of a pair handed to the judge (``gateway_cache_judge_total{verdict}``)."""
PAUSE_AFTER_ERROR_S = 10.0
"""After a call that brought no verdict (the backend failing, hanging past ``timeout_ms``),
no pair is put to the judge for this long: a backend that is down costs the judged misses
of one call in ten seconds, not ``rate_per_s`` of them (``paused``)."""
SYSTEM_PROMPT = (
    "You decide whether two questions ask for the same thing, so that one answer would "
    "fully and correctly serve both. Questions that differ in a number, a name, a place, a "
    "time, a direction, a negation, who does what to whom, or in what exactly they ask, "
    "are different. Reply with exactly one word: YES if one answer would serve both "
    "questions, otherwise NO."
)
QUESTION = (
    "Question A:\n<<<\n{first}\n>>>\n\nQuestion B:\n<<<\n{second}\n>>>\n\n"
    "Would one answer serve both questions? Reply YES or NO."
)
_THINKING = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_WORDS = re.compile(r"[a-z]+")
_DOUBT = frozenset(("no", "not", "but"))


def parse(answer: str) -> bool:
    """Whether the judge's answer is a clear yes: its first word "yes", and no "no", "not"
    or "but" after it.  Anything else (an empty answer, a hedge, a cut-off thought) is no."""
    words = _WORDS.findall(_THINKING.sub(" ", answer).lower())
    return bool(words) and words[0] == "yes" and not _DOUBT.intersection(words)


def request_body(first: str, second: str, model: str | None) -> bytes:
    """The judge's chat-completion request for the pair."""
    body: dict[str, Any] = {
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": QUESTION.format(first=first, second=second)},
        ],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "stream": False,
    }
    if model:
        body["model"] = model
    return json.dumps(body).encode()


def answer_text(body: bytes) -> str:
    """The first choice's message content of a chat-completion answer (``ValueError`` when
    there is none)."""
    try:
        content = json.loads(body)["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError, RecursionError) as exc:
        raise ValueError(f"no choices[0].message.content ({exc!r})") from exc
    if not isinstance(content, str):
        raise ValueError("choices[0].message.content is not text")
    return content


@dataclass(frozen=True, slots=True)
class Pair:
    """A grey-zone miss to judge: the asked message (and its normalised ``form``, what an
    alias is filed under) against the stored message of the entry at ``entry_key``, both in
    ``context`` (which holds the tenant scope and the backend's ``model_version``)."""

    context: str
    scope: str
    asked: str
    form: str
    cached: str
    entry_key: str
    created_at: float
    similarity: float
    model: str | None = None

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.context, self.form, self.entry_key)


@dataclass(frozen=True, slots=True)
class Alias:
    """A confirmed paraphrase: the entry it is answered by, as it was when judged
    (``created_at``: a replaced entry is another answer, and ends the alias)."""

    entry_key: str
    scope: str
    created_at: float
    similarity: float


class BackendJudge:
    """One route's judge: a bounded queue, a rate budget, one background task asking the
    route's backend, and the aliases and verdicts it has found."""

    def __init__(
        self,
        settings: Judge,
        transport: Transport,
        backend: Backend,
        *,
        clock: Clock,
        route: str = "",
        max_verdicts: int = MAX_VERDICTS,
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.route = route
        self.counts: Counter[str] = Counter()
        self._transport = transport
        self._clock = clock
        self._max_verdicts = max_verdicts
        self._bucket = TokenBucket(settings.rate_per_s, float(settings.burst), clock.now())
        self._queue: asyncio.Queue[Pair] = asyncio.Queue(maxsize=settings.max_pending)
        self._pending: set[tuple[str, str, str]] = set()
        self._verdicts: OrderedDict[tuple[str, str, str], bool] = OrderedDict()
        self._aliases: OrderedDict[tuple[str, str], Alias] = OrderedDict()
        self._by_entry: dict[str, set[tuple[str, str]]] = {}
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._paused_until = float("-inf")

    def __len__(self) -> int:
        return len(self._aliases)

    @property
    def pending(self) -> int:
        """Pairs waiting or being judged."""
        return len(self._pending)

    def submit(self, pair: Pair) -> str:
        """Hand ``pair`` over: "queued", "known" (judged or waiting already; a known yes is
        aliased again), "dropped", "rate_limited", "paused" or "closed"."""
        if self._closed:
            return "closed"
        key = pair.key
        if self._recall(pair) is not None or key in self._pending:
            return "known"
        if self._queue.full():
            self.counts["dropped"] += 1
            return "dropped"
        refused = self._spend()
        if refused is not None:
            return refused
        self._queue.put_nowait(pair)
        self._pending.add(key)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"judge {self.route}"
            )
        return "queued"

    async def decide(self, pair: Pair) -> bool | None:
        """``mode: inline``: the verdict on ``pair`` now, on the request's time.  None when
        there is none to be had: the pair is being judged already, ``max_pending`` pairs
        are, the rate budget is spent (each counted as in ``submit``), or the call failed
        or took longer than ``timeout_ms``.  A known verdict is given at once."""
        if self._closed:
            return None
        key = pair.key
        known = self._recall(pair)
        if known is not None:
            return known
        if key in self._pending:
            return None
        if len(self._pending) >= self.settings.max_pending:
            self.counts["dropped"] += 1
            return None
        if self._spend() is not None:
            return None
        self._pending.add(key)
        try:
            return await self._judge(pair)
        finally:
            self._pending.discard(key)

    def _recall(self, pair: Pair) -> bool | None:
        """The verdict already given on ``pair``, if any; a known yes is aliased again."""
        known = self._verdicts.get(pair.key)
        if known:
            self._file(pair)
        return known

    def _spend(self) -> str | None:
        """One call's worth of the rate budget: None when spent, else why not ("paused"
        after an error, or "rate_limited"), counted."""
        now = self._clock.now()
        if now < self._paused_until:
            self.counts["paused"] += 1
            return "paused"
        self._bucket.refill(now)
        if self._bucket.level < 1.0:
            self.counts["rate_limited"] += 1
            return "rate_limited"
        self._bucket.level -= 1.0
        return None

    def alias(self, context: str, form: str) -> Alias | None:
        """The alias filed for ``form`` in ``context``, if any."""
        found = self._aliases.get((context, form))
        if found is not None:
            self._aliases.move_to_end((context, form))
        return found

    def drop(self, context: str, form: str) -> None:
        """End an alias (its entry is gone or replaced)."""
        found = self._aliases.pop((context, form), None)
        if found is not None:
            self._unlink((context, form), found.entry_key)

    def forget(self, entry_key: str) -> int:
        """End every alias of ``entry_key`` (purged); how many there were."""
        keys = self._by_entry.pop(entry_key, set())
        for key in keys:
            self._aliases.pop(key, None)
        return len(keys)

    async def ask(self, first: str, second: str, model: str | None = None) -> bool:
        """Whether the backend says one answer serves both questions (raises
        ``UpstreamError`` or ``ValueError`` when it does not say)."""
        body = request_body(first, second, self.settings.model or model)
        headers = [("Content-Type", "application/json"), *self.backend.headers]
        reply = await self._transport.send(
            self.backend, "POST", JUDGE_PATH, headers, body, streaming=False
        )
        try:
            if reply.status != 200 or reply.body is None:
                raise UpstreamError(
                    f"judge {self.backend.name} {JUDGE_PATH} answered {reply.status}",
                    self.backend.name,
                )
            return parse(answer_text(reply.body))
        finally:
            if reply.close is not None:
                await reply.close()

    def drain(self) -> None:
        """Shutdown has begun: take no more pairs."""
        self._closed = True

    async def aclose(self) -> None:
        """Stop judging; pairs still waiting are let go."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        while True:
            pair = await self._queue.get()
            try:
                await self._judge(pair)
            finally:
                self._pending.discard(pair.key)

    async def _judge(self, pair: Pair) -> bool | None:
        """The verdict on ``pair`` (None: none came), counted, remembered, a yes filed."""
        timeout_s = self.settings.timeout_ms / 1000.0
        try:
            same = await asyncio.wait_for(self.ask(pair.cached, pair.asked, pair.model), timeout_s)
        except (GatewayError, OSError, ValueError, TimeoutError) as exc:
            self._failed()
            level = logging.DEBUG if self.counts["error"] > 1 else logging.WARNING
            log.log(level, "judge (%s): no verdict: %s", self.route, exc or type(exc).__name__)
            return None
        except Exception:
            self._failed()
            log.exception("judge (%s): the call failed", self.route)
            return None
        self.counts["yes" if same else "no"] += 1
        self._verdicts[pair.key] = same
        self._verdicts.move_to_end(pair.key)
        while len(self._verdicts) > self._max_verdicts:
            self._verdicts.popitem(last=False)
        if same:
            self._file(pair)
        return same

    def _failed(self) -> None:
        self.counts["error"] += 1
        self._paused_until = self._clock.now() + PAUSE_AFTER_ERROR_S

    def _file(self, pair: Pair) -> None:
        key = (pair.context, pair.form)
        self.drop(*key)
        self._aliases[key] = Alias(pair.entry_key, pair.scope, pair.created_at, pair.similarity)
        self._by_entry.setdefault(pair.entry_key, set()).add(key)
        while len(self._aliases) > self.settings.max_aliases:
            old_key, old = self._aliases.popitem(last=False)
            self._unlink(old_key, old.entry_key)

    def _unlink(self, key: tuple[str, str], entry_key: str) -> None:
        keys = self._by_entry.get(entry_key)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_entry[entry_key]

    def __repr__(self) -> str:
        counts = " ".join(f"{v}={self.counts[v]}" for v in VERDICTS if self.counts[v])
        return (
            f"<BackendJudge {self.route} backend={self.backend.name} "
            f"pending={self.pending}/{self.settings.max_pending} "
            f"aliases={len(self)}/{self.settings.max_aliases} verdicts={len(self._verdicts)} "
            f"tokens={self._bucket.level:.1f}/{self.settings.burst}"
            f"{' ' + counts if counts else ''}{' closed' if self._closed else ''}>"
        )
