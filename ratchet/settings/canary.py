"""A canary's settings (``aliases.<name>.canary`` in ratchet.yaml): how a gated candidate takes
live traffic, and what decides it (learner/canary.py, learner/canary_clients.py)."""

from __future__ import annotations

from pydantic import Field, model_validator

from ratchet.settings.base import _Section


class CanaryConfig(_Section):
    """A promoted candidate first takes ``weight`` of live traffic; 0 promotes at once."""

    weight: float = Field(
        default=0.1,
        ge=0.0,
        lt=1.0,
        description="Share of live traffic a promoted candidate first takes; 0 promotes at once.",
    )
    min_requests: int = Field(
        default=50,
        ge=1,
        description=(
            "Candidate answers a canary serves before it can be decided, counted by client: one "
            "client's answers count up to client_request_share of this, and answers the model "
            "server refused (4xx) not at all (learner/canary_counter.py)."
        ),
    )
    client_request_share: float = Field(
        default=0.1,
        gt=0.0,
        le=1.0,
        description=(
            "The most of min_requests one client's requests count for (an API key, or a vouched "
            "user): one client's volume cannot bring a canary to its decision. Without API keys "
            "everyone is one client, not capped."
        ),
    )
    min_clients: int = Field(
        default=20,
        ge=1,
        description=(
            "Distinct clients on each arm before ratings promote or roll back a canary (the test "
            "over clients, learner/canary_clients.py), and clients served on each arm before "
            "an unrated canary is decided on its errors. An alias with fewer clients is decided "
            "once feedback_wait_s has passed, on the evidence it has, and its event says so. "
            "20: below it one client moves the ratings' estimate by more than half of "
            "max_feedback_drop."
        ),
    )
    client_ratings: int = Field(
        default=10,
        ge=1,
        description=(
            "A client's unit is made of its first client_ratings ratings, whichever arms they "
            "fell on (on both: one paired unit, canary mean minus active mean): it counts at "
            "that many (a client with fewer counts when the wait runs out), and further "
            "ratings change nothing."
        ),
    )
    client_trim: float = Field(
        default=0.1,
        ge=0.0,
        lt=0.5,
        description=(
            "The share of clients trimmed from each end of each arm before the arms' means are "
            "compared (Yuen's test, learner/canary_clients.py): a few clients that tell the "
            "arms apart and rate one 0 and the other 1 are dropped, not averaged in."
        ),
    )
    min_duration_s: float = Field(
        default=300.0,
        ge=0.0,
        description=(
            "For an alias whose reward is not learned from ratings: a canary the ratings have not "
            "decided is decided on its error rate once it has run this long with min_clients "
            "clients served on each arm."
        ),
    )
    max_weight: float = Field(
        default=0.5,
        ge=0.0,
        lt=1.0,
        description=(
            "A quiet alias's canary takes a larger share, up to max_weight, so that it reaches "
            "min_requests within target_duration_s at the alias's recent request rate "
            "(learner/canary_weight.py): its users meet min_requests candidate answers either "
            "way, and a fixed 10% of a quiet alias takes far too long "
            "(docs/results/settings-measurements.md). A max_weight at or below weight keeps the "
            "share fixed."
        ),
    )
    target_duration_s: float = Field(
        default=300.0,
        gt=0,
        description=(
            "How long a canary should take to reach min_requests at the alias's recent "
            "request rate."
        ),
    )
    max_error_rate_increase: float = Field(
        default=0.02,
        ge=0.0,
        le=1.0,
        description=(
            "Roll back when the canary's upstream failure rate exceeds the active arm's by more "
            "than this, each client one unit (its own share of failures), shown by a test at "
            "fixed looks: at min_clients clients an arm, doubling, each made once and recorded, "
            "canary.alpha over all of them (learner/canary_errors.py). With fewer clients "
            "served the point estimate decides once feedback_wait_s has passed."
        ),
    )
    max_latency_increase: float | None = Field(
        default=1.0,
        ge=0.0,
        description=(
            "Roll back when the canary's clients' trimmed mean latency (ms a completion token "
            "for whole answers, time to first token for streams, each client one unit) is "
            "significantly above 1 + this times the active arm's, by Yuen's test over clients "
            "at the error test's fixed looks (learner/canary_latency.py). Latency never "
            "promotes. 1.0 (twice as slow), as outlier detection catches a broken replica, not "
            "a tuning: a first adapter against the base model is slower by LoRA's own cost, "
            "which at 0.25 rolled back the embedded stack's first canary "
            "(docs/results/canary-latency.md). 0 or null: off."
        ),
    )
    max_feedback_drop: float = Field(
        default=0.1,
        ge=0.0,
        lt=1.0,
        description=(
            "Ratings decide with a sequential test over clients (learner/canary_clients.py): "
            "promote once the canary's clients' mean rating is significantly no more than this "
            "below the active arm's, roll back once it is significantly more."
        ),
    )
    min_feedback: int = Field(
        default=10,
        ge=1,
        description=(
            "The reward-hacking guard compares the reward model with users' ratings from this "
            "many rated answers of each arm on (learner/guard.py)."
        ),
    )
    alpha: float = Field(
        default=0.05,
        gt=0.0,
        lt=0.5,
        description="The chance that ratings promote a canary worse than max_feedback_drop.",
    )
    max_rating_pairs: int = Field(
        default=1024,
        ge=1,
        description=(
            "Clients on each arm up to which the test over clients schedules interim looks "
            "(min_clients, doubling, learner/canary_clients.py); past it the test only looks "
            "again when feedback_wait_s runs out. Reaching it decides nothing by itself."
        ),
    )
    feedback_wait_s: float = Field(
        default=600.0,
        ge=0.0,
        description=(
            "Ratings arrive after the answers they rate: wait up to this long (from the "
            "canary's start) for the test over clients to decide, then let it look once at every "
            "client that rated, at any number (not shown within the margin: rolled back; with "
            "fewer than two clients' units to compare, the clients' mean drop decides, and "
            "unrated, the error rate). An alias that learns from "
            "ratings is never decided unrated before it; an alias with fewer than min_clients "
            "clients is decided on what it has once it has passed. 600 s, not 300: at 300 too "
            "many canaries 0.1 worse got through "
            "(docs/results/settings-measurements.md)."
        ),
    )

    @model_validator(mode="after")
    def _rating_pairs_fit(self) -> CanaryConfig:
        if self.max_rating_pairs < self.min_clients:
            raise ValueError(
                f"canary.max_rating_pairs ({self.max_rating_pairs}) is below "
                f"canary.min_clients ({self.min_clients}): ratings could never promote; "
                "raise max_rating_pairs or lower min_clients"
            )
        return self
