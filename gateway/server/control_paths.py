"""The model servers' own control endpoints, kept from clients (``server.control_paths``).

A model server answers more than inference on its port, and some of what it answers acts on
the server for every tenant at once: llama.cpp's server saves, restores and erases its
slots and sets the LoRA scales of every request; vLLM sleeps, wakes, pauses, resets its
prefix cache, runs RPCs on its workers and loads LoRA adapters (where its dev mode or runtime
LoRA updates are on); SGLang flushes its cache and swaps its weights; Ollama pulls, pushes,
copies and deletes models; Triton and MLServer load and unload models and register shared
memory, and Triton's log and trace settings change with a POST (so do ``gateway sim``'s
faults and simulated GPU).  A route that sends every
path to such a server (``routes: [{backend: main}]``, the usual sidecar's) would hand all of
that to any client.

With ``server.control_paths: refuse`` (the default) the gateway answers these with a 403
``control_path_refused`` before any route or backend is chosen, counted in
``gateway_control_paths_refused_total{tenant, server}``.  What only reads passes (llama.cpp's
``GET /props`` and ``/lora-adapters``, Ollama's ``/api/tags`` and ``/api/show``, a KServe
model's metadata and statistics, vLLM's ``/is_sleeping``).  ``pass`` forwards them as any
other path, for an operator who drives the server through the gateway.  The path matched is
the one forwarded, normalised at the edge (``target``): no other spelling of it
reaches a backend.
"""

from __future__ import annotations

import re

from gateway.errors import RequestError, shown

WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
Rules = tuple[tuple[str, str], ...]
ANY_METHOD: Rules = (
    ("llama.cpp", r"/slots(?:/[^/]*)?"),  # each slot's state; save, restore, erase
    ("llama.cpp", r"/models/(?:load|unload)"),  # its router mode
    (
        "vllm",
        r"/(?:reset_prefix_cache|reset_mm_cache|reset_encoder_cache|sleep|wake_up"
        r"|collective_rpc|start_profile|stop_profile|pause|resume|scale_elastic_ep"
        r"|server_info|update_weights|v1/load_lora_adapter|v1/unload_lora_adapter)",
    ),
    (
        "sglang",
        r"/(?:flush_cache|update_weights_from_[a-z_]+|init_weights_update_group"
        r"|release_memory_occupation|resume_memory_occupation|load_lora_adapter"
        r"|unload_lora_adapter|configure_logging|set_internal_state)",
    ),
    ("ollama", r"/api/(?:pull|push|create|copy|delete|blobs/[^/]+)"),
    ("kserve", r"/v2/repository(?:/.*)?"),  # Triton's and MLServer's index, load, unload
    ("kserve", r"/v2/(?:systemsharedmemory|cudasharedmemory)(?:/.*)?"),
)
"""Control endpoints whatever the method: (the server kind, the path)."""
WRITE_METHODS: Rules = (
    ("llama.cpp", r"/props|/lora-adapters"),  # a GET reads them
    ("sim", r"/sim/(?:config|reset)"),  # gateway sim's faults and GPU, set for every client
    ("kserve", r"/v2/logging|/v2(?:/models/[^/]+(?:/versions/[^/]+)?)?/trace/setting"),
)
"""Control endpoints when written to (``WRITES``); read, they pass."""


class ControlPathRefused(RequestError):
    """A client asked a model server's control endpoint (``server.control_paths``)."""

    status = 403
    code = "control_path_refused"


def _compiled(rules: Rules) -> re.Pattern[str]:
    """One pattern for ``rules``, a named group per rule (a trailing ``/`` allowed: FastAPI
    redirects it to the path without), in any case (Express, ASP.NET Core and Fiber route
    ``/SLOTS`` to ``/slots``)."""
    alternatives = "|".join(f"(?P<r{at}>(?:{path})/?)" for at, (_, path) in enumerate(rules))
    return re.compile(alternatives, re.IGNORECASE)  # a server may route without regard to case


_ANY = _compiled(ANY_METHOD)
_WRITE = _compiled(WRITE_METHODS)


def control_server(method: str, path: str) -> str | None:
    """The kind of server whose control endpoint ``method path`` is; None for any other."""
    found = _ANY.fullmatch(path)
    rules = ANY_METHOD
    if found is None and method in WRITES:
        found, rules = _WRITE.fullmatch(path), WRITE_METHODS
    if found is None or found.lastgroup is None:
        return None
    return rules[int(found.lastgroup[1:])][0]


def refusal(method: str, path: str, server: str) -> ControlPathRefused:
    return ControlPathRefused(
        f"{method} {shown(path)} is a model server's control endpoint ({server}): it acts on the "
        "server for every client, and the gateway does not pass it on "
        "(server.control_paths: refuse)"
    )
