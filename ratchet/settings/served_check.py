"""The ``learner.served_check`` section: that what the replicas serve is what the learner
trained (learner/fingerprint.py, learner/served_check.py, learner/drift.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ratchet.settings.base import _Section


class ServedCheckSettings(_Section):
    """`learner.served_check`: before a candidate is gated (hence before any canary or
    promotion), every vLLM replica loads it and answers a fixed probe, compared with the
    learner's fingerprint of it; and every round compares the logprobs vLLM logged when it
    sampled the round's groups with those the learner recomputes."""

    enabled: bool = Field(
        default=True,
        description=(
            "Check each replica before a candidate's gate, and each round's groups. Off: "
            "neither, as before this check existed."
        ),
    )
    served_precision: Literal["float32", "bfloat16"] = Field(
        default="bfloat16",
        description=(
            "What the vLLM replicas compute in (their --dtype; the embedded stack's is float32). "
            "The less precise of it and the learner's precision picks the tolerance."
        ),
    )
    tolerance_float32: float = Field(
        default=0.01,
        gt=0,
        description=(
            "Largest mean |Δ logprob| per token between the learner's and a replica's logprobs "
            "of the same tokens when both compute in float32 (docs/results/served-check.md)."
        ),
    )
    tolerance_bfloat16: float = Field(
        default=0.1,
        gt=0,
        description=(
            "The same when either computes in bfloat16 (or float16): rounding alone moves "
            "SmolLM2's probe logprobs by 0.03 to 0.05 per token (docs/results/served-check.md)."
        ),
    )
    wait_s: float = Field(
        default=60.0,
        ge=0,
        description=(
            "How long a replica that cannot load the candidate, serves it past the tolerance or "
            "cannot be reached is asked again (a store it sees late, a restart). Then one past "
            "the tolerance rejects the candidate, naming it; one whose vLLM says it cannot load "
            "it (404, 400) is out of that version's rotation; one still unreachable (refused, "
            "timeout, 5xx, 429) is not excluded, its traffic left to the outlier ejection. The "
            "candidate is rejected only when no replica serves it."
        ),
    )
    exclusion_ttl_s: float = Field(
        default=7 * 24 * 3600.0,
        ge=60,
        description=(
            "How long a replica stays out of a version's rotation after it could not load it; "
            "renewed while the version is its alias's active or canary one, so it lapses this "
            "long after the version leaves the registry."
        ),
    )
    reprobe_s: float = Field(
        default=300.0,
        ge=0,
        description=(
            "How often the canary watcher asks each replica out of a routed version's rotation "
            "for the version again (one probe each), and lets back in one that now serves it "
            "as trained: a replica that restarted, or a new pod at an excluded one's address. "
            "0: never asked again (the exclusion lapses only after the version leaves the "
            "registry)."
        ),
    )
    timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="Each probe request's time limit (it may load the adapter first).",
    )
    drift_groups: int = Field(
        default=8,
        ge=0,
        description=(
            "Groups per round whose sampled logprobs the learner recomputes before training, "
            "under the weights that served them (one forward pass, no gradient); a drift past "
            "the tolerance rejects the round's candidate. 0: not measured."
        ),
    )

    drift_min_tokens: int = Field(
        default=512,
        ge=1,
        description=(
            "Sampled tokens a replica's drift must rest on before it can block a candidate or "
            "roll back a canary: with drift_groups spread over many replicas, one replica's "
            "figure may rest on a group or two, and the worst of such noisy figures would "
            "block. Below it the figure is still exported and logged, and does not block."
        ),
    )

    def tolerance(self, learner_precision: Literal["float32", "bfloat16"]) -> float:
        """The tolerance of the less precise of the learner and the replicas."""
        both = {learner_precision, self.served_precision}
        return self.tolerance_bfloat16 if "bfloat16" in both else self.tolerance_float32
