"""Policies: the typed, immutable model (``model``), YAML loading with located errors
(``load``), the JSON Schema and reference docs derived from the model (``schema``), and
the file watcher that hot-reloads them (``watch``)."""

from gateway.policy.load import load_policy, parse_policy_text, zero_config_policy
from gateway.policy.model import Backend, Match, Policy, Route

__all__ = [
    "Backend",
    "Match",
    "Policy",
    "Route",
    "load_policy",
    "parse_policy_text",
    "zero_config_policy",
]
