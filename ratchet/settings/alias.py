"""Per-alias settings (``aliases.<name>`` in ratchet.yaml): reward, learning, sampling, gate,
canary and ratings."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    model_validator,
)

from ratchet.settings.base import (
    DEFAULT_BASE_MODEL,
    DEFAULT_RUBRIC,
    _Section,
)
from ratchet.settings.canary import CanaryConfig

# Packages whose verifiers left the kernel with the bundled tasks -> where they went (each with
# its trailing dot: the package and the modules under it, not a longer name that starts alike).
MOVED_VERIFIER_PACKAGES = {"ratchet.demo.": "tasks.demo.", "ratchet.tasks.": "tasks."}


def moved_verifier(spec: str) -> str | None:
    """The reference a verifier of the bundled tasks' old place has now, or None if it did not
    move: ``"ratchet.demo:f"`` -> ``"tasks.demo:f"``, ``"ratchet.tasks.x:f"`` -> ``"tasks.x:f"``."""
    module, colon, attr = spec.partition(":")
    for old, new in MOVED_VERIFIER_PACKAGES.items():
        if f"{module}.".startswith(old):
            return (new + f"{module}."[len(old) :]).removesuffix(".") + colon + attr
    return None


class RewardConfig(_Section):
    kind: Literal["ruler", "verifier", "mixed", "feedback"] = Field(
        default="ruler",
        description=(
            "feedback: a reward model learned from users' ratings "
            "(ratchet/rewards/reward_model.py)."
        ),
    )
    rubric: str = Field(
        default=DEFAULT_RUBRIC,
        description="What a good answer is, for the RULER judge.",
    )
    judge_model: str = Field(
        default=f"hosted_vllm/{DEFAULT_BASE_MODEL}",
        description="The judge model, as a litellm model id.",
    )
    verifier: str | None = Field(
        default=None, description='"package.module:function" returning a float in [0, 1]'
    )
    ruler_weight: float = Field(
        default=0.5,
        ge=0.0,
        le=1.0,
        description="kind mixed: the share of RULER in the reward; the verifier gives the rest.",
    )
    feedback_weight: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description=(
            "kind mixed: the share of the reward that the alias's reward model (learned from "
            "ratings) gives, once it is usable; the rest is RULER and the verifier as "
            "ruler_weight splits them. 0: ratings do not enter the reward."
        ),
    )

    @property
    def learns_from_ratings(self) -> bool:
        """Whether a reward model trained on users' ratings gives (part of) this reward."""
        return self.kind == "feedback" or (self.kind == "mixed" and self.feedback_weight > 0)

    @model_validator(mode="after")
    def _verifier_present(self) -> RewardConfig:
        if self.feedback_weight > 0 and self.kind != "mixed":
            raise ValueError(
                f"reward.feedback_weight is {self.feedback_weight} but reward.kind is "
                f"{self.kind!r}; it weighs the reward model inside kind: mixed (use kind: "
                "feedback for ratings alone)"
            )
        if self.kind in ("verifier", "mixed") and not self.verifier:
            raise ValueError(
                f"reward.kind is {self.kind!r} but reward.verifier is empty; "
                'set it to "package.module:function" or use kind: ruler'
            )
        if self.verifier and ":" not in self.verifier:
            raise ValueError('reward.verifier must look like "package.module:function"')
        if self.verifier and (new := moved_verifier(self.verifier)):
            raise ValueError(f"reward.verifier {self.verifier!r} moved: use {new!r}")
        return self


class LearningConfig(_Section):
    enabled: bool = Field(
        default=True,
        description="Whether the alias learns; off, it is served and logged only.",
    )
    sample_rate: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="Share of eligible traffic the judge turns into groups.",
    )
    group_size: int = Field(
        default=6,
        ge=2,
        le=64,
        description=(
            "6 answers a prompt: more of a new task's groups differ in reward than at 4 (a group "
            "whose answers all score alike teaches nothing), and vLLM decodes them in one batch."
        ),
    )
    heldout_fraction: float = Field(
        default=0.5,
        ge=0.0,
        lt=1.0,
        description=(
            "Half the prompts go to the gate. A round needs learner.batch_groups groups (32) and "
            "gate.min_pairs held-out prompts (32); where traffic is what limits both, as on a new "
            "or quiet alias, min_pairs / (min_pairs + batch_groups) of it makes them arrive "
            "together (measured: docs/results/settings-measurements.md). Where the judge cannot "
            "sample all the traffic, holding prompts out costs nothing (they are never sampled)."
        ),
    )
    max_prompt_tokens: int = Field(
        default=1024,
        ge=1,
        description="Prompts longer than this (in the model's tokens) are not re-sampled.",
    )
    dedup_window_s: int = Field(
        default=3600,
        ge=0,
        description=(
            "Within this window a training prompt is sampled once per version (the version its "
            "group comes from: once that changes, a new round can learn from the new policy's "
            "answers to it), a held-out prompt is kept once; 0: no dedup."
        ),
    )
    skip_after_flat_groups: int = Field(
        default=2,
        ge=0,
        description=(
            "A prompt whose last this many groups each had answers that all scored alike (no GRPO "
            "signal: solved, or out of reach) is not sampled again within the dedup window; a "
            "group whose answers differ resets the count. 0: always sampled."
        ),
    )
    max_key_share: float = Field(
        default=0.25,
        gt=0.0,
        le=1.0,
        description=(
            "No API key fills more than this share of a round's groups or of a gate's held-out "
            "pairs, so one client cannot steer what is learned or judged; with fewer than 1/share "
            "keys at hand each key gets an even share (one key alone, or auth off, is never held "
            "back)."
        ),
    )
    max_cost_per_day: float | None = Field(
        default=None,
        gt=0.0,
        description=(
            "The most the alias's judge calls (the judge's and the gate's) may cost a UTC day, in "
            "USD (litellm's price map: a local judge costs 0). Reached, the judge samples no more "
            "groups of the alias until the next day (`ratchet status` says so); rounds already "
            "under way finish. None: no cap."
        ),
    )


class SamplingConfig(_Section):
    """How the judge samples a group from the live version."""

    temperature: float = Field(
        default=0.7,
        ge=0.0,
        le=2.0,
        description=(
            "0.7, not 1.0: a small model's samples at 1.0 are mostly noise and teach less "
            "(docs/results/settings-measurements.md)."
        ),
    )
    top_p: float = Field(
        default=1.0,
        gt=0.0,
        le=1.0,
        description="Nucleus sampling of the groups.",
    )
    max_tokens: int | None = Field(
        default=None,
        ge=1,
        description=(
            "None: drawn from the alias's own served answer lengths (ratchet/answer_length.py), "
            "so a short-answer task does not sample 4x the tokens it needs. A number wins over "
            "that."
        ),
    )
    max_tokens_cap: int = Field(
        default=1024,
        ge=16,
        description=(
            "The most the automatic max_tokens (of groups and of the gate's answers) may be."
        ),
    )
    seed: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Set: each group is sampled with a vLLM seed mixed from this, the prompt and the live "
            "version, so a prompt sampled again gives the same group (replayable runs). None: "
            "unseeded."
        ),
    )


class GateConfig(_Section):
    """How a candidate is compared with the live version on held-out prompts."""

    min_pairs: int = Field(
        default=32,
        ge=1,
        description=(
            "The gate answers held-out pairs in order and stops as soon as a sequential test "
            "decides (ratchet/sequential.py). No pass before this many pairs, and the learner "
            "waits for this many held-out prompts before a round: 32 keeps a few lucky early "
            "pairs from promoting and rounds from waiting long for prompts "
            "(docs/results/settings-measurements.md)."
        ),
    )
    threshold: float = Field(
        default=0.5,
        ge=0.0,
        le=1.0,
        description=(
            "Promote only when the win rate's lower bound (always valid, or at the last look) is "
            "above this (0.5 = better)."
        ),
    )
    max_pairs: int = Field(
        default=128,
        ge=1,
        description=(
            "At most this many held-out pairs per gate, drawn at random from the pool. 128, not "
            "64: a typical one-round gain passes far more often at 128 "
            "(docs/results/settings-measurements.md); a clear gain stops far sooner."
        ),
    )
    alpha: float = Field(
        default=0.05,
        gt=0.0,
        lt=0.5,
        description=(
            "The false-promotion rate: the chance that a candidate no better than the live "
            "version passes. One-sided, because only promotion is guarded: a wrongly rejected "
            "candidate costs one round, a wrongly promoted one serves every user (and the canary "
            "is the second check)."
        ),
    )
    temperature: float = Field(
        default=0.0,
        ge=0.0,
        le=2.0,
        description="0 = greedy: both versions answer each prompt deterministically.",
    )
    max_tokens: int | None = Field(
        default=None,
        ge=1,
        description=(
            "None: from the served answer lengths of the prompts drawn (as sampling.max_tokens), "
            "so the pairs are cut where the groups the candidate trained on were."
        ),
    )
    max_failed_share: float = Field(
        default=0.1,
        ge=0.0,
        le=1.0,
        description=(
            "A pair is lost when the judge or vLLM fails on it (the candidate's own failure to "
            "answer counts as a loss instead). Failures that fall on the prompts a candidate "
            "would lose would pass it, so a gate with more than this share of its pairs lost does "
            "not pass."
        ),
    )
    min_lift: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description=(
            'None: a candidate passes on its win rate alone ("better more often than not"). Set: '
            "it must also lift the mean per-prompt score by at least this much (the point "
            "estimate of the lift the gate reports; needs scored pairs: a verifier or a reward "
            "model), so a promotion carries a gain worth a deploy."
        ),
    )

    @model_validator(mode="after")
    def _pairs_fit(self) -> GateConfig:
        if self.max_pairs < self.min_pairs:
            raise ValueError(
                f"gate.max_pairs ({self.max_pairs}) is below gate.min_pairs ({self.min_pairs}): "
                "no gate could ever pass; raise max_pairs or lower min_pairs"
            )
        return self


class FeedbackConfig(_Section):
    """What users' ratings may do for an alias."""

    max_share: float = Field(
        default=0.2,
        gt=0.0,
        le=1.0,
        description=(
            "The most of a canary arm's ratings (and of a reward model's training set) one API "
            "key's ratings may be: one client cannot steer what the alias learns or promotes."
        ),
    )
    retrain_every: int = Field(
        default=64,
        ge=1,
        description=(
            "With reward.kind feedback: a reward model is (re)trained once at least this many new "
            "ratings have been joined with the answers they rate ..."
        ),
    )
    retrain_growth: float = Field(
        default=0.5,
        ge=0.0,
        le=10.0,
        description=(
            "... and at least this share of the ratings the live model was trained on: retrains "
            "grow rarer as ratings pile up (a retrain on 1,000 ratings learns little from 64 "
            "more, and each one holds two cores for minutes). 0: every retrain_every ratings."
        ),
    )
    min_auc: float = Field(
        default=0.55,
        ge=0.5,
        lt=1.0,
        description=(
            "A model is used for rewards only while the lower end of its AUC's 95% interval, on "
            "ratings it never trained on, is above this: a few held-out ratings cannot make a "
            "model live by chance (0.80 on 13 ratings was 0.6 on 200 in issue 35's run), a larger "
            "set with a smaller but real signal can."
        ),
    )
    eval_fraction: float = Field(
        default=0.25,
        gt=0.0,
        lt=1.0,
        description="Share of the rated prompts kept out of training to evaluate the reward model.",
    )
    join_ttl_s: int = Field(
        default=3600,
        ge=60,
        description=(
            "How long an answer waits for its rating (and a rating for its answer's traffic "
            "record). A note of a few hundred bytes per answer (not its prompt: that is read back "
            "from Kafka when rated) is kept in Redis this long; the proxy keeps who got each "
            "answer as long."
        ),
    )
    max_ratings: int = Field(
        default=20_000,
        ge=1,
        description=(
            "Joined ratings kept per alias for training; past it, the client with the most loses "
            "its oldest (learner/ratings.py)."
        ),
    )
    max_ratings_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=1024 * 1024,
        description=(
            "... and their size in Redis, bytes (a rating keeps at most ~32 K characters of "
            "prompt and answer): size Redis's maxmemory for this per alias that learns from "
            "ratings."
        ),
    )
    max_reward_gap: float = Field(
        default=0.15,
        gt=0.0,
        le=1.0,
        description=(
            "The reward-hacking guard of an alias whose reward learns from ratings: a canary "
            "whose rated answers the reward model overrates (predicted minus the users' mean "
            "rating) by more than this beyond how it overrates the active version's, with 95% "
            "confidence, is rolled back and learning paused: the candidate learned to please the "
            "reward model, not the users."
        ),
    )
    require_reward_check: bool = Field(
        default=False,
        description=(
            "Roll a canary back, rather than promote it, when the reward-hacking guard could "
            "not check it (too few raters: fewer than canary.min_feedback held-out rated "
            "answers on an arm, each client counted at most its share; or no usable reward "
            "model). Off: the canary is promoted, and its event, the console and `ratchet "
            "status` say that the guard could not check."
        ),
    )
    regenerate_window_s: int = Field(
        default=0,
        ge=0,
        description=(
            "Set: the same API key asking the same prompt again within this many seconds rates "
            "the first answer 0 (the user regenerated it). 0: off. Needs API keys: without auth "
            'nobody is "the same user".'
        ),
    )
    judge_agreement: bool = Field(
        default=True,
        description=(
            "kind ruler or mixed: the judge also scores each rated served answer among re-samples "
            "of its prompt, to measure how far the judge agrees with the users "
            "(judge/agreement.py)."
        ),
    )
    agreement_window: int = Field(
        default=500,
        ge=10,
        description="The agreement is measured over this many most recent rated answers ...",
    )
    min_agreement: float = Field(
        default=0.6,
        ge=0.0,
        le=1.0,
        description=(
            "... and alerts (RatchetJudgeDisagreesWithUsers) when its pairwise accuracy is below "
            "this once agreement_min_pairs rated answers are in the window. 0.5 is a coin."
        ),
    )
    agreement_min_pairs: int = Field(
        default=50,
        ge=2,
        description="Rated answers in the window before the judge's agreement can alert.",
    )


class AliasConfig(_Section):
    base_model: str = Field(
        default=DEFAULT_BASE_MODEL,
        description="Served name of the base model in vLLM that this alias starts from.",
    )
    log_rate: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description=(
            "Share of this alias's exchanges written to ratchet.traffic (1.0 = all of them)."
        ),
    )
    reward: RewardConfig = RewardConfig()
    learning: LearningConfig = LearningConfig()
    sampling: SamplingConfig = SamplingConfig()
    gate: GateConfig = GateConfig()
    canary: CanaryConfig = CanaryConfig()
    feedback: FeedbackConfig = FeedbackConfig()

    @model_validator(mode="after")
    def _feedback_needs_a_canary(self) -> AliasConfig:
        if self.reward.learns_from_ratings and self.canary.weight == 0:
            what = (
                "reward.kind is 'feedback'"
                if self.reward.kind == "feedback"
                else "reward.feedback_weight is above 0"
            )
            raise ValueError(
                f"{what} but canary.weight is 0: a candidate trained against "
                "the reward model can fool the gate that uses the same model, so live ratings "
                "must decide; set canary.weight above 0 (for example 0.1)"
            )
        return self
