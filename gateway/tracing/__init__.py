"""Traces of requests: OpenTelemetry spans, sent over OTLP/HTTP (the ``otel`` extra).

One SERVER span per request, named and attributed by the OpenTelemetry GenAI conventions
(``chat llama-3``), with the gateway's own facts under ``gateway.``; child spans for the
cache lookup, the admission queue, the batch wait (built at the end from what the stages
wrote in ``Call.record``) and one CLIENT span per upstream call, whose context goes to the
backend as ``traceparent``.  An incoming ``traceparent`` is continued.

The package is split so that nothing imports OpenTelemetry unless a policy turns tracing on
(``tracing.sample_ratio`` above 0): the app imports ``otel`` then, and only then.  With
tracing off a request costs one attribute check at the edge (``Snapshot.tracer``).

attributes.py  what the spans say, from the facts of a Call, its Record and Reply (pure)
otel.py        the SDK side: provider, the reloadable sampler, exporter, the spans
"""
