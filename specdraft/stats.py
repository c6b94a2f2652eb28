"""Per-step statistics of a decoding run.

Conventions (as vLLM's spec-decode metrics and the EAGLE papers use them):

- ``mean_accepted_length`` counts the bonus/recovered token: it is output tokens per target
  forward, so plain decoding scores exactly 1.0 and a step that accepts all k drafts scores k + 1.
- ``acceptance_rate`` is accepted draft tokens / drafted tokens (token trees: accepted nodes /
  verified nodes, which a bushy tree keeps low however long its accepted paths are; its per-position
  counts are per depth).
- ``accepted_per_position[i]`` counts steps whose draft token i was accepted, and
  ``drafted_per_position[i]`` steps that proposed a token at position i; their ratio is the
  per-position acceptance curve.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SpecStats:
    """Counters filled by the engine; derived figures are properties.

    Attributes:
        steps: row-steps (one per row per target forward after prefill).
        target_forwards: batched target forwards (a forward over B rows counts once).
        drafted: draft tokens proposed (token trees: nodes verified).
        accepted: draft tokens accepted (token trees: nodes on the accepted paths).
        generated: output tokens.
        draft_time: seconds spent in the drafter.
        target_time: seconds spent in target forwards (verification and plain steps).
        prefill_time: seconds spent prefilling prompts.
        total_time: wall seconds of the whole run.
        drafted_per_position / accepted_per_position: per draft position counts.
        k_history: draft length used at each batched step.
        collapsed: requests the policy flagged as collapsed (:attr:`specdraft.policy.CostAwareK.collapsed`).
    """

    steps: int = 0
    target_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    generated: int = 0
    draft_time: float = 0.0
    target_time: float = 0.0
    prefill_time: float = 0.0
    total_time: float = 0.0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    k_history: list[int] = field(default_factory=list)
    collapsed: int = 0

    def observe(
        self,
        num_drafted: torch.Tensor,
        num_accepted: torch.Tensor,
        num_emitted: torch.Tensor,
        depth: torch.Tensor | None = None,
    ) -> None:
        """Record one batched step.

        Args:
            num_drafted: ``(B,)`` draft tokens proposed per active row (a token tree: its nodes).
            num_accepted: ``(B,)`` accepted per row.
            num_emitted: ``(B,)`` tokens actually kept per row (after EOS / length truncation).
            depth: ``(B,)`` a token tree's depth per row: the per-position counts are then per
                depth (a row "drafted position i" when its tree reaches depth i + 1). None: a chain.
        """
        drafted, accepted = num_drafted.tolist(), num_accepted.tolist()  # lists: this runs every step
        reach = drafted if depth is None else depth.tolist()
        k = max(reach, default=0)
        self.target_forwards += 1
        self.k_history.append(k)
        self.steps += len(drafted)
        self.drafted += sum(drafted)
        self.accepted += sum(accepted)
        self.generated += sum(num_emitted.tolist())
        if k:
            grow = k - len(self.drafted_per_position)
            if grow > 0:
                self.drafted_per_position += [0] * grow
                self.accepted_per_position += [0] * grow
            for i in range(k):
                self.drafted_per_position[i] += sum(r > i for r in reach)
                self.accepted_per_position[i] += sum(a > i for a in accepted)

    def merge(self, other: SpecStats) -> None:
        """Add another run's counters (e.g. per-prompt stats into a benchmark total)."""
        for name in ("steps", "target_forwards", "drafted", "accepted", "generated", "collapsed"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("draft_time", "target_time", "prefill_time", "total_time"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in (
            (self.drafted_per_position, other.drafted_per_position),
            (self.accepted_per_position, other.accepted_per_position),
        ):
            mine += [0] * (len(theirs) - len(mine))
            for i, v in enumerate(theirs):
                mine[i] += v
        self.k_history += other.k_history

    @property
    def mean_accepted_length(self) -> float:
        """Output tokens per row-step, bonus/recovered token included (plain decoding: 1.0)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per wall second, prefill included (what a user waits for)."""
        return self.generated / self.total_time if self.total_time > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second of decoding (prefill excluded)."""
        t = self.total_time - self.prefill_time
        return self.generated / t if t > 0 else 0.0

    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "target_forwards": self.target_forwards,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "generated": self.generated,
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
            "draft_time_s": round(self.draft_time, 4),
            "target_time_s": round(self.target_time, 4),
            "prefill_time_s": round(self.prefill_time, 4),
            "total_time_s": round(self.total_time, 4),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance()],
            "collapsed": self.collapsed,
        }

    def summary(self) -> str:
        """A few human-readable lines for the CLI."""
        lines = [
            (
                f"generated {self.generated} tokens in {self.total_time:.2f} s: {self.tokens_per_s:.1f} "
                f"tok/s (decode {self.decode_tokens_per_s:.1f} tok/s)"
            ),
            (
                f"target forwards {self.target_forwards}, mean accepted length "
                f"{self.mean_accepted_length:.2f} (bonus token included), acceptance "
                f"{self.acceptance_rate:.1%} ({self.accepted}/{self.drafted})"
            ),
            (
                f"time: draft {self.draft_time:.2f} s, target {self.target_time:.2f} s, prefill "
                f"{self.prefill_time:.2f} s"
            ),
        ]
        if self.drafted_per_position:
            curve = " ".join(f"{x:.2f}" for x in self.per_position_acceptance())
            lines.append(f"acceptance per draft position: {curve}")
        return "\n".join(lines)
