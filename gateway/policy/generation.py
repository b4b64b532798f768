"""How much one call may ask a model to generate (``routes[].generation``).

A model server gives each call what it asks: ``max_tokens: 32000`` holds a slot (and its KV
cache) for as long as 32,000 tokens take, and ``n: 64`` decodes 64 answers for one request
that rate limits count once.  The route's bounds are the operator's: the most output tokens
one call may ask for, the bound written into a call that names none (a call that names none
may otherwise generate up to the model's context), and the most choices (``n``,
``best_of``) one call may ask for.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.policy.match import glob_regex
from gateway.policy.metadata import doc

Found = list[tuple[str, str]]

OUTPUT_FIELDS = {
    "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
    "/v1/completions": ("max_tokens",),
    "/v1/responses": ("max_output_tokens",),
    "/v1/messages": ("max_tokens",),  # Anthropic's
    # llama.cpp's own API: n_predict, else max_tokens (which OpenAI-shaped servers read too)
    "/completion": ("max_tokens", "n_predict"),
    # llama.cpp serves OpenAI's chat and Responses API without /v1 too: the same calls, read
    # as its own API's (else a client dropping /v1 would escape every bound)
    "/chat/completions": ("max_tokens", "max_completion_tokens"),
    "/responses": ("max_output_tokens",),
    "/completions": ("max_tokens", "n_predict"),
    "/infill": ("max_tokens", "n_predict"),  # llama.cpp's code infilling
    "/api/generate": ("options.num_predict",),  # Ollama's
    "/api/chat": ("options.num_predict",),
    # TGI's; SGLang's (sampling_params); vLLM's demonstration server's (at the top)
    "/generate": ("parameters.max_new_tokens", "sampling_params.max_new_tokens", "max_tokens"),
    "/generate_stream": ("parameters.max_new_tokens",),
    "/": ("parameters.max_new_tokens",),  # TGI's compatibility route, where its clients post
    # SageMaker's route, which vLLM and TGI both serve: chat, a completion or TGI's generate,
    # told apart by the body
    "/invocations": ("max_tokens", "max_completion_tokens", "parameters.max_new_tokens"),
    "/inference/v1/generate": ("sampling_params.max_tokens",),  # vLLM's tokens in, tokens out
}
"""Per generation endpoint, the fields bounding a call's output (a dotted name: a member of
an object member).  A call that names none is given the first whose object it sent, else
the one its prompt's field names its server by (``BY_PROMPT``), else the first (chat's
``max_tokens``, which every server reads)."""
BY_PROMPT = {
    "/generate": {
        "inputs": "parameters.max_new_tokens",  # TGI's
        "text": "sampling_params.max_new_tokens",  # SGLang's
        "input_ids": "sampling_params.max_new_tokens",
        "prompt": "max_tokens",  # vLLM's api_server: SamplingParams' own fields at the top
    },
    "/invocations": {
        "inputs": "parameters.max_new_tokens",  # TGI's generate
        "messages": "max_tokens",  # chat (vLLM's, TGI's)
        "prompt": "max_tokens",  # a completion (vLLM's)
    },
}
"""Where several servers share a path, the field naming a call's prompt names its server,
and so the field its default bound is written in: each refuses, or ignores, the others'."""
PROMPT_KINDS: dict[str, type | tuple[type, ...]] = {
    "inputs": str,  # TGI's: one text (TEI's texts to embed are a list)
    "messages": list,
    "prompt": (str, list),
}
"""What a prompt to generate from is, by the field naming it."""
PROMPT_NEEDED = {"/": ("inputs",), "/invocations": tuple(BY_PROMPT["/invocations"])}
"""Paths any server may answer (a root, SageMaker's route), bounded only for a body that
names a prompt to generate from in one of these fields (``PROMPT_KINDS``): another body
there (TEI's, ``inputs`` a list of texts to embed; an embedding's ``input``) is sent as it
came, neither bounded nor given a default."""


PARAMETER_LISTS = {"/generate": "sampling_params"}
"""Paths whose parameters may be a list, one object for each prompt of a batch (SGLang's
``sampling_params``): each is bounded as the parameters of a call of its own."""
LISTED_CALLS = {"/vertex": ("instances", "/invocations")}
"""Paths whose body lists calls, each bounded as a call to another path: TGI's Vertex AI
route, ``{"instances": [...]}``, each a TGI generate (``inputs``, ``parameters``) or a chat
request, all answered at once."""


def generates(path: str, data: Mapping[str, Any]) -> bool:
    """Whether a call to ``path`` with the JSON ``data`` asks for a generation: always,
    but on a ``PROMPT_NEEDED`` path, where its body must name a prompt so."""
    needed = PROMPT_NEEDED.get(path)
    return needed is None or any(isinstance(data.get(f), PROMPT_KINDS[f]) for f in needed)


NATIVE_PATHS = frozenset(OUTPUT_FIELDS) - {p for p in OUTPUT_FIELDS if p.startswith("/v1/")}
"""The servers' own APIs, whose bodies the gateway reads only for a route's bounds, and
where a bound below 1 asks for none (llama.cpp's and Ollama's -1: until the end; -2: until
the context is full)."""
TRITON_GENERATE = re.compile(r"/v2/models/[^/]+(?:/versions/[^/]+)?/generate(?:_stream)?")
"""Triton's generate extension, whose JSON names a model's inputs at the top (TensorRT-LLM's
``max_tokens``) and the request's parameters under ``parameters`` (vLLM's backend reads
``max_tokens`` there, or in ``sampling_parameters``, the JSON text of its parameters, which
it reads in their place)."""
TRITON_INFER = re.compile(r"/v2/models/[^/]+(?:/versions/[^/]+)?/infer")
"""Triton's KServe V2 ``infer``, where TensorRT-LLM's ``max_tokens`` is an input tensor
(bounded by ``gateway.openai.triton_bounds``)."""
TRITON_FIELDS = ("parameters.max_tokens", "sampling_parameters.max_tokens", "max_tokens")
"""Its fields bounding a call's output; a call naming none is given ``parameters``' (a
request parameter a backend that reads none ignores; an input it does not declare, Triton
refuses)."""
TEXT_MEMBERS = frozenset({"sampling_parameters"})
"""Members a server reads as the JSON text of an object: the gateway reads, bounds and
writes them as text."""


def output_fields(path: str) -> tuple[str, ...] | None:
    """The fields bounding a call's output on ``path`` (``OUTPUT_FIELDS``, Triton's
    ``TRITON_FIELDS``); None on a path that generates nothing."""
    fields = OUTPUT_FIELDS.get(path)
    if fields is None and path.startswith("/v2/") and TRITON_GENERATE.fullmatch(path):
        return TRITON_FIELDS
    return fields


def is_native(path: str) -> bool:
    """Whether ``path`` is a generation endpoint of a server's own API."""
    if path in NATIVE_PATHS or path in LISTED_CALLS:
        return True
    return path.startswith("/v2/") and TRITON_GENERATE.fullmatch(path) is not None


CHOICE_FIELDS = {
    "/v1/chat/completions": ("n",),
    "/chat/completions": ("n",),  # llama.cpp's, without /v1
    "/invocations": ("n",),  # SageMaker's route (vLLM's, TGI's)
    "/v1/completions": ("n", "best_of"),
    # SGLang's parallel sampling; TGI's best_of, which decodes that many
    "/generate": ("sampling_params.n", "parameters.best_of"),
    "/generate_stream": ("parameters.best_of",),
    "/": ("parameters.best_of",),
}
"""Per endpoint, the fields asking for several answers to one call (dotted: a member of an
object member)."""
PROMPT_LISTS = {
    "/v1/completions": ("prompt",),
    "/completion": ("prompt",),  # llama.cpp's
    "/completions": ("prompt",),
    "/generate": ("text", "input_ids"),  # SGLang's batch
}
"""Endpoints whose prompt field may hold a list of prompts, each answered (``n`` times)."""


def dotted(data: Mapping[str, Any], name: str) -> Any:
    """``data``'s field ``name``, a dotted name reaching into an object member
    (``options.num_predict``); None where it or its object is absent, or that is no object."""
    outer, _, inner = name.rpartition(".")
    holder = data.get(outer) if outer else data
    return holder.get(inner) if isinstance(holder, Mapping) else None


def tensor_value(path: str, name: str, value: Any) -> Any:
    """``value``, of the field ``name`` of a call to ``path``, as Triton's generate reads an
    input tensor at the top of its body: a value, or a list of one (``"max_tokens": [20]``);
    elsewhere, as it is."""
    if isinstance(value, list) and len(value) == 1 and "." not in name and path[:4] == "/v2/":
        return value[0]
    return value


def prompt_list(path: str, data: Mapping[str, Any]) -> tuple[str, int]:
    """The field naming a call's prompts, and how many prompts a call to ``path`` asks
    answers for: its prompt field's list (``PROMPT_LISTS``), else one."""
    for name in PROMPT_LISTS.get(path, ()):
        if name in data:
            return name, prompts_in(data[name])
    return "prompt", 1


def prompts_of(path: str, data: Mapping[str, Any]) -> int:
    """How many prompts a call to ``path`` asks answers for (``prompt_list``)."""
    return prompt_list(path, data)[1]


def prompts_in(prompt: Any) -> int:
    """How many prompts ``prompt`` holds: a list of texts or of token lists is one each;
    anything else (a text, one token list, tokens and texts mixed: llama.cpp's one prompt)
    is one."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        return len(prompt)
    return 1


@dataclass(frozen=True, slots=True)
class Generation:
    """Bounds on what one call may ask a model to generate."""

    max_tokens: int | None = field(
        default=None,
        metadata=doc(
            "The most output tokens one call may ask for (chat's `max_completion_tokens` and "
            "`max_tokens`, a completion's `max_tokens`, the Responses API's "
            "`max_output_tokens`, Anthropic's `max_tokens`; the servers' own APIs: "
            "llama.cpp's `/completion` and `/infill` `n_predict`, Ollama's "
            "`options.num_predict`, TGI's `parameters.max_new_tokens`, SGLang's "
            "`sampling_params.max_new_tokens`, vLLM's `/generate` `max_tokens`, Triton's "
            "`/v2/models/<m>/generate` `max_tokens`, `parameters.max_tokens` or "
            "`sampling_parameters`' `max_tokens`; `/v2/models/<m>/infer`: the `max_tokens` "
            "input tensor, `sampling_parameters`' and `parameters.max_tokens`, never "
            "defaulted). A call asking more is clamped to it or refused "
            "(`over`); a call naming none is given `default_max_tokens`, or this. None: any."
        ),
    )
    default_max_tokens: int | None = field(
        default=None,
        metadata=doc(
            "The bound written into a call that names none (or `null`), so that it cannot "
            "generate up to the model's whole context; at most `max_tokens`. None: "
            "`max_tokens` where that is set, else the call goes as sent."
        ),
    )
    max_choices: int | None = field(
        default=None,
        metadata=doc(
            "The most choices one call may ask for (`n`; a completion's `best_of`, which "
            "decodes that many; SGLang's `sampling_params.n`, TGI's `parameters.best_of`; "
            "times the prompts of a completion's `prompt` list or SGLang's `text` or "
            "`input_ids` list, each answered): past it a 400 (`param` names the field). "
            "None: any."
        ),
    )
    over: Literal["clamp", "refuse"] = field(
        default="clamp",
        metadata=doc(
            "A call asking more than `max_tokens`: `clamp` sends it with `max_tokens` (its "
            "answer may stop at `finish_reason: length`), `refuse` answers 400 "
            "`invalid_request_error` naming the field."
        ),
    )

    @property
    def bounds_tokens(self) -> bool:
        """Whether calls' output bounds are written or checked."""
        return self.max_tokens is not None or self.default_max_tokens is not None


def tighter(one: Generation | None, other: Generation | None) -> Generation | None:
    """The bounds of both (a route's and a named tenant's): each the lower where both give
    it, the default within the most, ``refuse`` where either refuses."""
    if one is None or other is None:
        return one or other

    def low(a: int | None, b: int | None) -> int | None:
        return b if a is None else a if b is None else min(a, b)

    most = low(one.max_tokens, other.max_tokens)
    default = low(one.default_max_tokens, other.default_max_tokens)
    return Generation(
        max_tokens=most,
        default_max_tokens=low(default, most) if default is not None else None,
        max_choices=low(one.max_choices, other.max_choices),
        over="refuse" if "refuse" in (one.over, other.over) else "clamp",
    )


def takes_generations(path_glob: str) -> bool:
    """Whether a route matching paths by ``path_glob`` can take a generation: a path of
    ``OUTPUT_FIELDS``, or Triton's generate (``/v2/*`` or one model's)."""
    matches = glob_regex(path_glob).match
    return (
        any(map(matches, (*OUTPUT_FIELDS, "/v2/models/m/generate", "/v2/models/m/infer")))
        or TRITON_GENERATE.fullmatch(path_glob) is not None
        or TRITON_INFER.fullmatch(path_glob) is not None
    )


def check_generation(generation: Generation, takes_generations: bool) -> Found:
    """A route's ``generation``: positive bounds, a default within the most, on a route a
    generation can take (``takes_generations``)."""
    found: Found = []
    for key in ("max_tokens", "default_max_tokens", "max_choices"):
        value = getattr(generation, key)
        if value is not None and value < 1:
            found.append((f"generation.{key}", "must be at least 1"))
    most, default = generation.max_tokens, generation.default_max_tokens
    if most is not None and default is not None and default > most:
        found.append(("generation.default_max_tokens", f"must be at most max_tokens ({most})"))
    if generation == Generation(over=generation.over):
        found.append(("generation", "bounds nothing: give max_tokens, default_max_tokens or "
                      "max_choices"))  # fmt: skip
    if not takes_generations:
        found.append(
            (
                "generation",
                "only applies to a route a generation can take: its path must match "
                + ", ".join(
                    (*sorted(OUTPUT_FIELDS), "/v2/models/<m>/generate", "/v2/models/<m>/infer")
                ),
            )
        )
    return found
