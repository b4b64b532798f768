"""What a backend's tokens cost (``backends.<name>.price``), for chargeback and spend budgets."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.policy.metadata import doc


@dataclass(frozen=True, slots=True)
class Price:
    """What a backend's tokens cost, for chargeback: per million, in one currency (the same
    for every backend)."""

    input_per_million: float = field(default=0.0, metadata=doc("A million prompt tokens."))
    output_per_million: float = field(
        default=0.0, metadata=doc("A million generated (completion) tokens.")
    )

    def of(self, prompt: int, completion: int) -> float:
        return (prompt * self.input_per_million + completion * self.output_per_million) / 1e6
