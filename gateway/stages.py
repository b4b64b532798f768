"""The pipeline's stages, in order: the rate history of routes that forecast it, the model
the backend is asked for, the merge of model lists over several backends, cache lookup,
single flight, shadow traffic, batching, then admission, throttling, breakers and fallback
around the forward to a backend.

``build`` makes the stage list for one policy generation.  Stages keep per-request rules
from the policy snapshot they are built with, and take their long-lived state (stores,
batchers, breakers, queues) from the runtime's registry so it survives reloads.  A stage
whose route does not use its capability passes the call straight on; a capability no route
uses adds no stage at all.
"""

from __future__ import annotations

import gateway.batching.stage
import gateway.cache.stage
import gateway.coalesce.stage
import gateway.mirror.stage
import gateway.openai.file_ids
import gateway.openai.generation
import gateway.openai.model_lists
import gateway.openai.response_ids
import gateway.openai.stream_usage
import gateway.openai.target_models
import gateway.pool.stage
import gateway.resilience.stage
from gateway.cache.embedding_seam import TierFactory
from gateway.pipeline import Stage
from gateway.policy.model import Policy
from gateway.runtime import Runtime

__all__ = ["Runtime", "build"]


def build(
    policy: Policy, runtime: Runtime, *, embedding_tiers: TierFactory | None = None
) -> list[Stage]:
    """The stages for ``policy``, in pipeline order (``embedding_tiers``: the cache's
    embedding tier factory, when not the shipped one)."""
    return [
        # 0. request-rate history of the routes that forecast it (prewarm)
        *gateway.pool.stage.build(policy, runtime),
        # 0. files, batches and uploads bound to their tenant (tenants.response_id_secret)
        *gateway.openai.file_ids.build(policy, runtime.metrics),
        # 0. the Responses API's ids bound to their tenant (tenants.response_id_secret)
        *gateway.openai.response_ids.build(policy, runtime.metrics),
        # 0. the model the backend is asked for (target_models), drawn by weight
        *gateway.openai.target_models.build(policy, runtime.metrics),
        # 0. how much one call may ask the model to generate (generation)
        *gateway.openai.generation.build(policy, runtime.metrics),
        # 0. a stream's usage asked for where its client did not (stream_usage: ask)
        *gateway.openai.stream_usage.build(policy),
        # 0. one model list over several backends (merge_models), each asked down the line
        *gateway.openai.model_lists.build(policy, runtime.metrics),
        # 1. cache lookup: exact, SimHash, embedding tiers
        *gateway.cache.stage.build(policy, runtime, embedding_tiers),
        # 2. single flight: identical in-flight calls share one
        *gateway.coalesce.stage.build(policy, runtime),
        # 3. shadow traffic: a copy of each call that goes upstream, to the route's mirror
        *gateway.mirror.stage.build(policy, runtime),
        # 3. micro-batching into array calls
        *gateway.batching.stage.build(policy, runtime),
        # 4. rate limits, admission, throttle, breakers and fallback around the forward
        *gateway.resilience.stage.build(policy, runtime),
    ]
