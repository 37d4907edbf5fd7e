"""`SpecStats`: what speculation proposed and what the target model accepted, cumulative. Torch-free.

Counters follow vLLM's spec-decode metrics: drafts (verifications with at least one draft token), draft
tokens, accepted tokens, and accepted tokens per draft position (position i counts verifications whose
first i + 1 drafts were all accepted). Derived: the acceptance rate (accepted / draft tokens), the rate per
position (accepted at i / drafts), and the mean accepted length, tokens per verification including the
one the target adds (1 + accepted / drafts), vLLM's "mean acceptance length".
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    k: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.k

    def record(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for i in range(min(accepted, self.k)):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_pos]

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_rate_per_pos": self.acceptance_rate_per_pos,
            "mean_accepted_length": self.mean_accepted_length,
        }
