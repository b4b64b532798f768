"""Protecting a backend: admission with a bounded priority queue, circuit breakers, throttle
rules over GPU telemetry and their wiring, per-tenant rate limits, the retry budget, the
quality fallback, and the stage that applies them around the forward."""
