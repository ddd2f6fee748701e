"""One typed settings object for every Ratchet service.

Values come, highest priority first, from: keyword arguments, ``RATCHET_*`` environment
variables (nested sections with ``__``, e.g. ``RATCHET_PROXY__PORT=9000``), then ``ratchet.yaml``
(``$RATCHET_CONFIG``, else ``./ratchet.yaml``, or ``--config PATH``). Each service reads the part
it needs. Validation happens at start; :func:`load_settings` turns pydantic's errors into one
message per bad setting that names it and says how to fix it.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Any, Literal

import re2
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    NestedSecretsSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    YamlConfigSettingsSource,
)

# \Z, not $: "$" would also accept a name followed by a newline.
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}\Z")
# A DNS name (or an IPv4 address); IPv6 addresses are checked with ipaddress.
_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_HOST_PATTERN = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*\.?\Z")
NAME_RULE = (
    "lower-case letters, digits, '.', '_' or '-', starting with a letter or digit, "
    "at most 64 characters"
)
DEFAULT_BASE_MODEL = "smollm2-135m-instruct"
DEFAULT_RUBRIC = (
    "A good answer follows the user's instructions, is correct, complete and concise. "
    "A worse answer is wrong, ignores part of the request, or pads with irrelevant text."
)


def default_home() -> Path:
    """Where the embedded stack keeps its state, logs, model cache and adapter store."""
    return Path(os.environ.get("RATCHET_HOME", Path.home() / ".cache" / "ratchet"))


class ConfigError(Exception):
    """Settings that cannot start a service; the message names each setting and its fix."""


class _Section(BaseModel):
    # A typo in ratchet.yaml should fail loudly, not be ignored.
    model_config = ConfigDict(extra="forbid")


class RewardConfig(_Section):
    # feedback: a reward model learned from users' ratings (ratchet/rewards/reward_model.py).
    kind: Literal["ruler", "verifier", "mixed", "feedback"] = "ruler"
    rubric: str = DEFAULT_RUBRIC
    judge_model: str = f"hosted_vllm/{DEFAULT_BASE_MODEL}"
    verifier: str | None = Field(
        default=None, description='"package.module:function" returning a float in [0, 1]'
    )
    ruler_weight: float = Field(default=0.5, ge=0.0, le=1.0)
    # kind mixed: the share of the reward that the alias's reward model (learned from ratings)
    # gives, once it is usable; the rest is RULER and the verifier as ruler_weight splits them.
    # 0: ratings do not enter the reward.
    feedback_weight: float = Field(default=0.0, ge=0.0, le=1.0)

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
        return self


class LearningConfig(_Section):
    enabled: bool = True
    # Share of eligible traffic the judge turns into groups.
    sample_rate: float = Field(default=1.0, ge=0.0, le=1.0)
    # 6 answers a prompt: more of a new task's groups differ in reward than at 4 (a group whose
    # answers all score alike teaches nothing), and vLLM decodes them in one batch.
    group_size: int = Field(default=6, ge=2, le=64)
    # Half the prompts go to the gate. A round needs learner.batch_groups groups (32) and
    # gate.min_pairs held-out prompts (32); where traffic is what limits both, as on a new or
    # quiet alias, min_pairs / (min_pairs + batch_groups) of it makes them arrive together. At a
    # quarter the demo's first round waited for held-out prompts until minute 14 with its groups
    # ready at 7; at a half it started at 9 (bench/loop_speed.py). Where the judge cannot sample
    # all the traffic, holding prompts out costs nothing (they are never sampled).
    heldout_fraction: float = Field(default=0.5, ge=0.0, lt=1.0)
    # Prompts longer than this (in the model's tokens) are not re-sampled.
    max_prompt_tokens: int = Field(default=1024, ge=1)
    # Within this window a training prompt is sampled once per version (the version its group
    # comes from: once that changes, a new round can learn from the new policy's answers to it),
    # a held-out prompt is kept once; 0: no dedup.
    dedup_window_s: int = Field(default=3600, ge=0)
    # A prompt whose last this many groups each had answers that all scored alike (no GRPO
    # signal: solved, or out of reach) is not sampled again within the dedup window; a group
    # whose answers differ resets the count. 0: always sampled.
    skip_after_flat_groups: int = Field(default=2, ge=0)
    # No API key fills more than this share of a round's groups or of a gate's held-out pairs,
    # so one client cannot steer what is learned or judged; with fewer than 1/share keys at
    # hand each key gets an even share (one key alone, or auth off, is never held back).
    max_key_share: float = Field(default=0.25, gt=0.0, le=1.0)
    # The most the alias's judge calls (the judge's and the gate's) may cost a UTC day, in USD
    # (litellm's price map: a local judge costs 0). Reached, the judge samples no more groups of
    # the alias until the next day (`ratchet status` says so); rounds already under way finish.
    # None: no cap.
    max_cost_per_day: float | None = Field(default=None, gt=0.0)


class SamplingConfig(_Section):
    """How the judge samples a group from the live version."""

    # 0.7: measured with bench/demo_learning.py, groups sampled at 1.0 trained a 135M model to
    # 0.50-0.59 on the demo, at 0.7 to 0.58-0.66 (a small model's samples at 1.0 are mostly noise).
    temperature: float = Field(default=0.7, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    # None: drawn from the alias's own served answer lengths (ratchet/answer_length.py),
    # so a short-answer task does not sample 4x the tokens it needs. A number wins over that.
    max_tokens: int | None = Field(default=None, ge=1)
    # The most the automatic max_tokens (of groups and of the gate's answers) may be.
    max_tokens_cap: int = Field(default=1024, ge=16)
    # Set: each group is sampled with a vLLM seed mixed from this, the prompt and the live
    # version, so a prompt sampled again gives the same group (replayable runs). None: unseeded.
    seed: int | None = Field(default=None, ge=0)


class GateConfig(_Section):
    """How a candidate is compared with the live version on held-out prompts."""

    # The gate answers held-out pairs in order and stops as soon as a sequential test decides
    # (ratchet/sequential.py). No pass before this many pairs, and the learner waits for this
    # many held-out prompts before a round: 32 keeps a few lucky early pairs from promoting and
    # rounds from waiting long for prompts (simulated: a 0.8 win rate passes at a median of 32).
    min_pairs: int = Field(default=32, ge=1)
    # Promote only when the win rate's lower bound (always valid, or at the last look) is above
    # this (0.5 = better).
    threshold: float = Field(default=0.5, ge=0.0, le=1.0)
    # At most this many held-out pairs per gate, drawn at random from the pool. 128, not 64:
    # simulated by the betting test alone with a third ties, a 0.63 win rate (the demo's
    # typical one-round gain) passed 76% of the time at 128 but 34% at 64; with the last look
    # (bench/gate_power.py, a quarter ties) a 0.6 win rate passes 78% at 128. A clear gain
    # stops far sooner.
    max_pairs: int = Field(default=128, ge=1)
    # The false-promotion rate: the chance that a candidate no better than the live version
    # passes. One-sided, because only promotion is guarded: a wrongly rejected candidate costs
    # one round, a wrongly promoted one serves every user (and the canary is the second check).
    alpha: float = Field(default=0.05, gt=0.0, lt=0.5)
    # 0 = greedy: both versions answer each prompt deterministically.
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    # None: from the served answer lengths of the prompts drawn (as sampling.max_tokens), so the
    # pairs are cut where the groups the candidate trained on were.
    max_tokens: int | None = Field(default=None, ge=1)
    # A pair is lost when the judge or vLLM fails on it (the candidate's own failure to answer
    # counts as a loss instead). Failures that fall on the prompts a candidate would lose would
    # pass it, so a gate with more than this share of its pairs lost does not pass.
    max_failed_share: float = Field(default=0.1, ge=0.0, le=1.0)
    # None: a candidate passes on its win rate alone ("better more often than not"). Set: it
    # must also lift the mean per-prompt score by at least this much (the point estimate of the
    # lift the gate reports; needs scored pairs: a verifier or a reward model), so a promotion
    # carries a gain worth a deploy.
    min_lift: float | None = Field(default=None, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _pairs_fit(self) -> GateConfig:
        if self.max_pairs < self.min_pairs:
            raise ValueError(
                f"gate.max_pairs ({self.max_pairs}) is below gate.min_pairs ({self.min_pairs}): "
                "no gate could ever pass; raise max_pairs or lower min_pairs"
            )
        return self


class CanaryConfig(_Section):
    """A promoted candidate first takes ``weight`` of live traffic; 0 promotes at once."""

    weight: float = Field(default=0.1, ge=0.0, lt=1.0)
    min_requests: int = Field(default=50, ge=1)
    # A quiet alias's canary takes a larger share, up to max_weight, so that it reaches
    # min_requests within target_duration_s at the alias's recent request rate
    # (learner/canary_weight.py): its users meet min_requests candidate answers either way, and
    # at 10% the embedded stack's ~20 answers a minute took 25 minutes. A max_weight at or below
    # weight keeps the share fixed.
    max_weight: float = Field(default=0.5, ge=0.0, lt=1.0)
    target_duration_s: float = Field(default=300.0, gt=0)
    # Roll back when the canary's server error rate exceeds the active arm's by more than this.
    max_error_rate_increase: float = Field(default=0.02, ge=0.0, le=1.0)
    # Ratings decide with a sequential test (learner/canary_ratings.py): promote once the
    # canary's mean rating is significantly no more than this below the active arm's, roll back
    # once it is significantly more.
    max_feedback_drop: float = Field(default=0.1, ge=0.0, lt=1.0)
    # No promotion on ratings before this many rating pairs (one rating from each arm).
    min_feedback: int = Field(default=10, ge=1)
    # The chance that ratings promote a canary worse than max_feedback_drop.
    alpha: float = Field(default=0.05, gt=0.0, lt=0.5)
    # Rating pairs after which a test that has not shown the canary not worse rolls it back.
    # Thumbs ratings of two equal arms need about 500 pairs to show a drop below 0.1 (simulated:
    # 91% pass by 1024, 28% by 256); a clearly better or worse canary is decided in about 50.
    max_rating_pairs: int = Field(default=1024, ge=1)
    # Ratings arrive after the answers they rate: once the canary has min_requests, wait up to
    # this long (from the canary's start) for the ratings' test to decide, then let it look once
    # at the pairs it has (at least 30: else error rate and the ratings' point estimate decide).
    # 0 decides at min_requests with what has arrived. At 20 answers a minute, 80% rated
    # (bench/canary_time.py): 600 s promotes a canary 0.1 better 100% of the time on a rating
    # scale, 62% on thumbs, one 0.1 worse at most 5%; 300 s let 9-11% of those through.
    feedback_wait_s: float = Field(default=600.0, ge=0.0)

    @model_validator(mode="after")
    def _rating_pairs_fit(self) -> CanaryConfig:
        if self.max_rating_pairs < self.min_feedback:
            raise ValueError(
                f"canary.max_rating_pairs ({self.max_rating_pairs}) is below "
                f"canary.min_feedback ({self.min_feedback}): ratings could never promote; "
                "raise max_rating_pairs or lower min_feedback"
            )
        return self


class FeedbackConfig(_Section):
    """What users' ratings may do for an alias."""

    # The most of a canary arm's ratings (and of a reward model's training set) one API key's
    # ratings may be: one client cannot steer what the alias learns or promotes.
    max_share: float = Field(default=0.2, gt=0.0, le=1.0)
    # With reward.kind feedback: a reward model is (re)trained once at least this many new
    # ratings have been joined with the answers they rate ...
    retrain_every: int = Field(default=64, ge=1)
    # ... and at least this share of the ratings the live model was trained on: retrains grow
    # rarer as ratings pile up (a retrain on 1,000 ratings learns little from 64 more, and each
    # one holds two cores for minutes). 0: every retrain_every ratings.
    retrain_growth: float = Field(default=0.5, ge=0.0, le=10.0)
    # A model is used for rewards only while the lower end of its AUC's 95% interval, on ratings
    # it never trained on, is above this: a few held-out ratings cannot make a model live by
    # chance (0.80 on 13 ratings was 0.6 on 200 in issue 35's run), a larger set with a smaller
    # but real signal can.
    min_auc: float = Field(default=0.55, ge=0.5, lt=1.0)
    # Share of the rated prompts kept out of training to evaluate the reward model.
    eval_fraction: float = Field(default=0.25, gt=0.0, lt=1.0)
    # How long an answer waits for its rating (and a rating for its answer's traffic record).
    # A note of a few hundred bytes per answer (not its prompt: that is read back from Kafka when
    # rated) is kept in Redis this long; the proxy keeps who got each answer as long.
    join_ttl_s: int = Field(default=3600, ge=60)
    # Joined ratings kept per alias for training; past it, the client with the most loses its
    # oldest (learner/ratings.py).
    max_ratings: int = Field(default=20_000, ge=1)
    # ... and their size in Redis, bytes (a rating keeps at most ~32 K characters of prompt and
    # answer): size Redis's maxmemory for this per alias that learns from ratings.
    max_ratings_bytes: int = Field(default=64 * 1024 * 1024, ge=1024 * 1024)
    # The reward-hacking guard of an alias whose reward learns from ratings: a canary whose rated
    # answers the reward model overrates (predicted minus the users' mean rating) by more than
    # this beyond how it overrates the active version's, with 95% confidence, is rolled back and
    # learning paused: the candidate learned to please the reward model, not the users.
    max_reward_gap: float = Field(default=0.15, gt=0.0, le=1.0)
    # Set: the same API key asking the same prompt again within this many seconds rates the
    # first answer 0 (the user regenerated it). 0: off. Needs API keys: without auth nobody is
    # "the same user".
    regenerate_window_s: int = Field(default=0, ge=0)
    # kind ruler or mixed: the judge also scores each rated served answer among re-samples of
    # its prompt, to measure how far the judge agrees with the users (judge/agreement.py).
    judge_agreement: bool = True
    # The agreement is measured over this many most recent rated answers ...
    agreement_window: int = Field(default=500, ge=10)
    # ... and alerts (RatchetJudgeDisagreesWithUsers) when its pairwise accuracy is below this
    # once agreement_min_pairs rated answers are in the window. 0.5 is a coin.
    min_agreement: float = Field(default=0.6, ge=0.0, le=1.0)
    agreement_min_pairs: int = Field(default=50, ge=2)


class AliasConfig(_Section):
    base_model: str = DEFAULT_BASE_MODEL
    # Share of this alias's exchanges written to ratchet.traffic (1.0 = all of them).
    log_rate: float = Field(default=1.0, ge=0.0, le=1.0)
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


class KafkaSettings(_Section):
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_cafile: Path | None = None
    topic_partitions: int = Field(default=3, ge=1)
    topic_replication: int = Field(default=1, ge=1)
    topic_retention_ms: int = Field(default=7 * 24 * 3600 * 1000, ge=60_000)
    # gzip needs no native library, so it works on every machine the proxy runs on.
    compression: Literal["gzip", "snappy", "lz4", "zstd", "none"] = "gzip"
    # Idempotent producing needs broker support (InitProducerId); "auto" probes for it.
    idempotence: Literal["auto", "on", "off"] = "auto"
    # How long a consumer group member may go silent before the broker drops it (heartbeats
    # every third of it). A restarted judge or learner waits about this long for its group;
    # kafka-python's 10 s made each join wait 20 s or more on Tansu.
    session_timeout_ms: int = Field(default=6000, ge=3000, le=300_000)

    def client_options(self) -> dict[str, Any]:
        """Connection options shared by kafka-python producers, consumers and admin clients."""
        opts: dict[str, Any] = {"security_protocol": self.security_protocol}
        if self.sasl_mechanism:
            opts["sasl_mechanism"] = self.sasl_mechanism
            opts["sasl_plain_username"] = self.sasl_username
            opts["sasl_plain_password"] = (
                self.sasl_password.get_secret_value() if self.sasl_password else None
            )
        if self.ssl_cafile:
            opts["ssl_cafile"] = str(self.ssl_cafile)
        return opts


class RateLimitSettings(_Section):
    """`proxy.rate_limit`: per-key limits every proxy replica shares through Redis; a key over
    one gets 429 and retry-after. All off by default: a sensible number depends on the model and
    the hardware, and without keys every client would share one bucket (a global limit)."""

    # Requests a key may start per minute, refilled continuously (a token bucket)...
    requests_per_minute: int | None = Field(default=None, ge=1, le=1_000_000)
    # ...and at most this many at once; unset, a full minute's worth.
    burst: int | None = Field(default=None, ge=1, le=1_000_000)
    # Prompt + completion tokens, refilled continuously: a request reserves its prompt (estimated)
    # plus n x max_tokens at admission, refused when that much is not left, and is settled to
    # what it used after the answer (proxy/buckets.py: also a stream cut short, a 504, ...).
    tokens_per_minute: int | None = Field(default=None, ge=1, le=10**10)
    tokens_per_day: int | None = Field(default=None, ge=1, le=10**12)
    # The longest a request waits for Redis to check it; past that it is checked as below.
    timeout_s: float = Field(default=0.05, gt=0, le=5.0)
    # While Redis cannot check a request (slow past timeout_s, down, or full), request rates are
    # checked by each replica on its own, in process; token budgets too with "local", while
    # "closed" refuses the requests they would check with 503 and retry-after: a replica's own
    # bucket starts from what Redis last said, so a long outage with many replicas could spend a
    # day's budget several times over.
    budgets_without_redis: Literal["closed", "local"] = "closed"

    @model_validator(mode="after")
    def _burst_needs_a_rate(self) -> RateLimitSettings:
        if self.burst is not None and self.requests_per_minute is None:
            raise ValueError(
                "proxy.rate_limit.burst is set but proxy.rate_limit.requests_per_minute is not; "
                "set both, or remove burst"
            )
        return self


class ProxySettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=8400, ge=1, le=65535)
    # Client keys. Empty means no auth, which is only allowed on a loopback address.
    api_keys: list[SecretStr] = []
    admin_key: SecretStr | None = None
    # Keys of apps that tell their end users apart with the request's `user` field (and
    # /v1/feedback's): for these the per-client caps (learning.max_key_share, the canary's and the
    # reward model's per-client ratings) count each (key, user) as a client. Only list a key whose
    # app sets `user` itself, never one handed to end users: they could then be anyone they like.
    user_vouching_keys: list[SecretStr] = []
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    upstream_connect_timeout_s: float = Field(default=2.0, gt=0)
    upstream_timeout_s: float = Field(default=300.0, gt=0)
    # Records accepted and not yet sent or spooled by the log worker process; past it, dropped.
    log_queue_size: int = Field(default=10_000, ge=1)
    # Regexes applied to every string of a record (request, its keys, `user`, error, answers)
    # before it is produced; matches become [REDACTED]. RE2 syntax (linear time): no
    # backreferences or lookaround, and \w, \d, \b are ASCII only (\p{L} is a letter of any script).
    redact_patterns: list[str] = []
    # Redaction time per record; past it, the strings not yet redacted are replaced whole, the
    # record marked cut (no one learns from it) and counted. RE2 needs ~30 ms for 1 MiB.
    redact_budget_s: float = Field(default=0.5, gt=0, le=60)
    # A log worker that holds frames and confirms none for this long is killed and replaced; the
    # frame it was handling is dropped (reason worker_stuck). A healthy one confirms every 0.2 s.
    log_worker_stuck_s: float = Field(default=30.0, ge=1, le=3600)
    # A full re-read of the routing table, on top of the pub/sub push.
    registry_refresh_s: float = Field(default=5.0, gt=0)
    upstream_health_interval_s: float = Field(default=2.0, gt=0)
    # How a request's vLLM replica is chosen (vllm_endpoints): "affinity", by its served name
    # with bounded loads and, once its version spreads, by its conversation (ratchet/fleet.py);
    # "version", by served name alone; "round_robin", each in turn (the last two are
    # bench/fleet_routing.py's peers; round-robin also suits a fleet that serves no adapters).
    balance: Literal["affinity", "version", "round_robin"] = "affinity"
    # Tell clients their canary arm (x-ratchet-canary-arm) and, while a canary runs, the version
    # that answered. Off: a client that knew its arm could rate only that arm's answers.
    expose_arm: bool = False
    # Per-key request rates and token budgets, shared by all replicas (proxy/ratelimit.py).
    rate_limit: RateLimitSettings = RateLimitSettings()
    # /metrics names aliases, versions, canary arms and traffic volumes: on, it needs the admin
    # key. Unset: on unless host is loopback (off loopback without an admin key, nobody reads it).
    metrics_auth: bool | None = None
    # Limits on one request, each refused with a 4xx that names it (proxy/validation.py).
    # Nesting of the JSON body; deeper would cost recursion everywhere the body is walked, and
    # orjson writes at most 254 levels.
    max_json_depth: int = Field(default=64, ge=2, le=128)
    # Values in all the body's objects and arrays together: what bounds its parsed size (each
    # small value costs 30-100 bytes). Unknown fields pass through (vLLM and OpenAI clients send
    # vendor fields), so this, not a field list, is the bound. Raise it only to send prompts of
    # more token ids than this.
    max_json_items: int = Field(default=262_144, ge=1024, le=1 << 24)
    # Chat messages per request; each one costs a walk and a line in the record.
    max_messages: int = Field(default=1024, ge=1, le=100_000)
    # Choices per request: each one is a whole generation on vLLM.
    max_n: int = Field(default=16, ge=1, le=128)
    # max_tokens / max_completion_tokens; unset, the model's context (vLLM's max_model_len).
    max_tokens: int | None = Field(default=None, ge=1, le=10_000_000)
    # n x prompts (a /v1/completions prompt list multiplies the work; chat has one prompt).
    max_choices: int = Field(default=64, ge=1, le=4096)
    # A non-streamed answer is held whole in memory and copied to the log: past this, refused;
    # a stream's log copy past this is dropped (the exchange is counted, not logged).
    max_answer_bytes: int = Field(default=16 * 1024 * 1024, ge=65536, le=1 << 30)
    # The largest record the log worker produces. A bigger one (a long request, or an answer
    # with n, top_logprobs or prompt_logprobs) is stored cut down and marked `truncated`,
    # never dropped and never blocking others. Keep it below the broker's message.max.bytes
    # (Kafka's default is 1 MiB); the producer's request limit is set 64 KiB above it.
    max_record_bytes: int = Field(default=900 * 1024, ge=64 * 1024, le=64 * 1024 * 1024)
    # The disk spool's bound while Kafka is away: past it, newer records are dropped and counted
    # (reason spool_full) and the oldest kept, so an outage never fills the volume.
    spool_max_bytes: int = Field(default=1024 * 1024 * 1024, ge=1 << 20, le=1 << 40)
    # Bytes waiting for the log worker (on top of log_queue_size records): the pipe's memory.
    log_queue_bytes: int = Field(default=128 * 1024 * 1024, ge=1 << 20, le=1 << 34)
    # Slow clients (proxy/connection.py): the request line and headers must arrive within
    # header_timeout_s of the connection or their first read, the body within body_timeout_s of
    # the headers; a client that reads none of its answer for body_timeout_s is dropped.
    header_timeout_s: float = Field(default=10.0, gt=0, le=300)
    body_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    # An idle keep-alive connection is closed after this; behind a load balancer, keep it above
    # the balancer's own idle timeout.
    keepalive_timeout_s: float = Field(default=5.0, gt=0, le=3600)
    # Request line + headers; llhttp itself has no limit.
    max_header_bytes: int = Field(default=32 * 1024, ge=1024, le=1 << 20)
    # At this many open connections (or requests in progress), a new request gets 503.
    max_concurrency: int = Field(default=1024, ge=1, le=1_000_000)
    # Responses API (POST /v1/responses, store: true, OpenAI's default): how long a response
    # is kept in Redis for GET /v1/responses/{id} and previous_response_id (0: none is), and the
    # largest kept, with its conversation. Redis holds at most responses/s x TTL x this.
    responses_store_ttl_s: int = Field(default=3600, ge=0, le=30 * 86400)
    responses_store_max_bytes: int = Field(default=256 * 1024, ge=1024, le=64 * 1024 * 1024)

    @field_validator("api_keys")
    @classmethod
    def _keys_not_blank(cls, keys: list[SecretStr]) -> list[SecretStr]:
        # A blank key (an unset environment variable) would match a request with no key at all.
        for index, key in enumerate(keys):
            if not key.get_secret_value().strip():
                raise ValueError(
                    f"key {index} is blank; remove it, or set it (an unset environment variable "
                    "gives a blank key)"
                )
        return keys

    @field_validator("admin_key")
    @classmethod
    def _admin_key_not_blank(cls, key: SecretStr | None) -> SecretStr | None:
        if key is not None and not key.get_secret_value().strip():
            raise ValueError("is blank; remove it or set it to a real key")
        return key

    @model_validator(mode="after")
    def _vouching_keys_are_client_keys(self) -> ProxySettings:
        known = {k.get_secret_value() for k in self.api_keys}
        for index, key in enumerate(self.user_vouching_keys):
            if key.get_secret_value() not in known:
                raise ValueError(
                    f"proxy.user_vouching_keys[{index}] is not one of proxy.api_keys; a key can "
                    "only vouch for its users if it is a client key: add it to api_keys too"
                )
        return self

    @property
    def metrics_need_admin_key(self) -> bool:
        """Whether /metrics asks for the admin key: metrics_auth, else whether the proxy is
        reachable from beyond this machine."""
        return self.metrics_auth if self.metrics_auth is not None else not _is_loopback(self.host)

    @model_validator(mode="after")
    def _metrics_auth_needs_admin_key(self) -> ProxySettings:
        if self.metrics_auth and self.admin_key is None:
            raise ValueError(
                "proxy.metrics_auth is on but proxy.admin_key is not set: nobody could read "
                "/metrics. Set proxy.admin_key (RATCHET_PROXY__ADMIN_KEY) or turn metrics_auth off"
            )
        return self

    @field_validator("redact_patterns")
    @classmethod
    def _patterns_compile(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            try:
                redaction_regex([pattern])
            except re2.error as exc:
                raise ValueError(
                    f"redact pattern {pattern!r} does not compile with RE2 ({_re2_reason(exc)}); "
                    "redaction uses RE2 so that it takes linear time: write it without "
                    "backreferences or lookaround (e.g. a character class instead of a lookahead)"
                ) from exc
        try:
            redaction_regex(patterns)
        except re2.error as exc:  # each compiles alone: together they are too large
            raise ValueError(
                f"the redact patterns together do not compile with RE2 ({_re2_reason(exc)}); "
                "use fewer or smaller patterns"
            ) from exc
        return patterns


def _re2_reason(exc: Exception) -> str:
    reason = exc.args[0] if exc.args else exc
    return reason.decode(errors="replace") if isinstance(reason, bytes) else str(reason)


def redaction_regex(patterns: list[str]) -> Any:
    """One RE2 regex matching any of ``patterns``: the log worker's redaction (linear time in
    the text, whatever the pattern). Raises ``re2.error`` for what RE2 cannot compile."""
    options = re2.Options()
    options.log_errors = False  # the error is raised (and reported with its pattern), not logged
    return re2.compile("|".join(f"(?:{p})" for p in patterns), options)


class JudgeSettings(_Section):
    consumer_group: str = "ratchet-judge"
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(default=8402, ge=1, le=65535)
    # Groups sampled and judged at once; the judge model and vLLM see this many calls in flight.
    # Measured on the 2-core machine (bench/judge_sampling.py, demo prompts, K=4, automatic
    # max_tokens 64, a shared and loaded machine): 4.7, 8.0, 12.7 and 12.5 groups/min at 1, 2, 4
    # and 8; past 4 a group only waits longer. A GPU vLLM batches far more: raise it there.
    concurrency: int = Field(default=4, ge=1, le=256)
    poll_records: int = Field(default=16, ge=1)
    # Where litellm reaches the judge model; empty means the embedded vLLM (vllm_url + /v1).
    judge_api_base: str | None = None
    judge_api_key: SecretStr | None = None
    judge_timeout_s: float = Field(default=60.0, gt=0)
    judge_retries: int = Field(default=3, ge=0)
    judge_max_tokens: int = Field(default=1024, ge=16)
    cache_ttl_s: int = Field(default=7 * 24 * 3600, ge=1)
    sample_timeout_s: float = Field(default=300.0, gt=0)
    # A traffic record whose outputs Kafka acknowledged is marked judged in Redis for this long,
    # so the judge replica that re-reads an uncommitted batch (after a crash or a rebalance)
    # skips it instead of judging it twice. 0 turns the marks off.
    done_ttl_s: int = Field(default=3600, ge=0, le=30 * 24 * 3600)
    # Backpressure: sample for an alias only while fewer than this many rounds' groups
    # (x learner.batch_groups) are produced and not yet trained on. 0: no bound. Measured: without
    # one the judge sampled 89 groups while the round needed 32.
    max_pending_rounds: int = Field(default=2, ge=0)
    # Don't sample while the alias's round trains, writes or is gated: right where vLLM and the
    # learner share cores (a round of 32 groups trained in 1,259 s beside sampling, 75 s alone;
    # the gate's answers take vLLM), and the groups sampled after the gate come from where the
    # next round starts; off where the learner has hardware of its own.
    pause_while_training: bool = False


class LearnerSettings(_Section):
    """`ratchet learner`: when rounds run, how they train, and when learning pauses itself."""

    consumer_group: str = "ratchet-learner"
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(default=8403, ge=1, le=65535)
    # A round runs when this many usable groups wait for an alias...
    # The round's size and steps and the learning rate were chosen on every bundled task with
    # bench/demo_learning.py: three rounds, each on 32 groups sampled from the last candidate,
    # held-out greedy lift after each (README, "Defaults"). 8 steps of 4 groups at 2e-3 lifted
    # the three tasks by +0.12, +0.60 and +0.96 in all after rounds 1, 2 and 3; 32 steps of one
    # group at 1e-3 (the demo's earlier choice) by +0.18, +0.42, +0.79; 32 steps of one group at
    # 2e-3 collapsed sorting's first round and bullets' third into empty answers.
    batch_groups: int = Field(default=32, ge=1)
    # ...or when at least min_groups wait and this long has passed since the oldest of them
    # arrived and since the alias's last round (or gate) ended. A judge pauses while the learner
    # trains and gates, so the few groups in flight when a round began had waited through it:
    # counted from their arrival alone, they started the next round on their own as soon as it
    # ended (bullets, 2026-11-29: a round of 4 groups, then a 10-minute gate of a candidate no
    # different from the live one, with the judge paused).
    interval_s: float = Field(default=300.0, gt=0)
    min_groups: int = Field(default=4, ge=1)
    # Groups sampled by a version more than this many promotions behind the live one are dropped.
    max_staleness: int = Field(default=1, ge=0)
    # Groups held in memory per alias while a round or a canary is under way; older ones drop.
    max_waiting_groups: int = Field(default=256, ge=1)
    steps_per_round: int = Field(default=8, ge=1)
    learning_rate: float = Field(default=2e-3, gt=0)
    # Passes over a round's groups (PPO epochs), each of steps_per_round steps. From the second
    # on, a step whose policy has moved past epoch_max_kl (the token-mean KL from the sampling
    # policy, k3) or clips more than epoch_max_clip_frac of its tokens is not taken and the round
    # ends there: the importance ratio corrects a small move, not a large one.
    epochs_per_round: int = Field(default=1, ge=1, le=16)
    epoch_max_kl: float = Field(default=0.02, gt=0)
    epoch_max_clip_frac: float = Field(default=0.2, gt=0, le=1.0)
    # A candidate the gate rejected while it won more than the threshold of its pairs is where
    # the next round starts (ratchet/carry.py), up to this many rounds of training beyond the
    # live version; 1: every round starts from the live version. A round of a few dozen groups
    # gains too little for any gate to prove (five rounds in a row rejected at 0.53-0.62), and
    # the judge samples a carried round's groups from the candidate itself, so rounds build on
    # one another as on-policy GRPO does: bench/demo_learning.py, three rounds of 32 groups each
    # sampled from the last round's candidate, lifted every bundled task more each round (held-out
    # greedy, base -> rounds 1, 2, 3: bullets 0.20 -> 0.32, 0.40, 0.51; demo 0.48 -> 0.53, 0.64,
    # 0.75; sorting 0.42 -> 0.44, 0.48, 0.64). Beyond four, a lineage that never proves itself
    # starts again from the live version.
    max_candidate_rounds: int = Field(default=4, ge=1)
    # While a candidate's canary waits for users' ratings, the next round trains on from it
    # (the judge samples from it) and its candidate is gated once the canary ends; rolled back,
    # that round is lost. Off: no round runs during a canary.
    train_during_canary: bool = True
    # Padded tokens per forward and backward; a longer row (one group) is a micro-batch alone.
    # Measured on 2 cores, one step of 4 demo-shaped groups (a 250-token prompt and 6 answers of
    # 100): 1024 trains at 61 tok/s with a 4.4 GiB peak, 2048 at 55 with 6.8 GiB, 4096 at 52-56
    # with 9.6 GiB, the same loss to 1e-8. Small batches lose nothing on a CPU; a GPU may want more.
    micro_batch_tokens: int = Field(default=1024, ge=64)
    # 0 turns clipping off.
    max_grad_norm: float = Field(default=1.0, ge=0)
    # AdamW's decoupled weight decay: pulls the LoRA weights toward zero, i.e. toward the base
    # model. Off by default, as in TRL's GRPOConfig.
    weight_decay: float = Field(default=0.0, ge=0.0)
    lora_rank: int = Field(default=8, ge=1, le=32)  # the embedded vLLM allows rank <= 32
    lora_alpha: int = Field(default=16, ge=1)
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    lora_target_modules: list[str] | Literal["all-linear"] = "all-linear"
    scale_rewards: Literal["group", "batch", "none"] = "group"
    loss_mode: Literal["ppo_clip", "cispo"] = "ppo_clip"
    epsilon_low: float = Field(default=0.2, ge=0.0, lt=1.0)
    epsilon_high: float = Field(default=0.28, ge=0.0)
    cispo_max_weight: float = Field(default=5.0, gt=0)
    kl_beta: float = Field(default=0.0, ge=0.0)
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # The forward and backward's arithmetic: "bf16" autocasts them to bfloat16 (weights, LoRA and
    # AdamW stay float32 on a CPU); "auto" is bf16 on a GPU, float32 on a CPU: there the embedded
    # vLLM samples in float32, and a bf16 learner's mismatched logprobs cost more learning than
    # its 1.2-1.3x speed on AMX buys (learner/trainer.py uses_bf16).
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    # Under torchrun (learner.devices > 1 in the chart): "replicate", each rank holds the whole
    # base (for a base that fits one device: one all-reduce of the LoRA gradient a step);
    # "fsdp", the base, LoRA and optimizer state sharded over the ranks with FSDP2 (a base too
    # large for one device; weights gathered layer by layer). learner/parallel.py.
    sharding: Literal["replicate", "fsdp"] = "replicate"
    # Torch's CPU threads for training. Empty: torch's default, every core. On a machine that
    # also serves vLLM, fewer: torch's threads meet at a barrier after every op, so one thread
    # starved by vLLM stalls them all (measured: a round's step 50x slower than alone). The
    # embedded stack sets what vLLM leaves free.
    cpu_threads: int | None = Field(default=None, ge=1)
    # Where the learner's base weights are (the value vLLM was started with as --model, which is
    # also what each adapter's base_model_name_or_path must say). Required by the learner, and by
    # the judge for an alias that learns from ratings; `ratchet up` sets it to the embedded model.
    base_model_path: str | None = None
    # Gate answers in flight at once. vLLM batches them: on the CPU build, 48 greedy answers of 64
    # tokens take 43 s at 4, 27 s at 16, 24 s at 48 (measured); a GPU gains more.
    gate_concurrency: int = Field(default=16, ge=1, le=256)
    gate_timeout_s: float = Field(default=120.0, gt=0)
    # Held-out prompts kept per alias for the gate; when full, the key holding the most loses
    # its oldest, so a flood from one key cannot push the others' prompts out.
    heldout_pool: int = Field(default=1024, ge=1)
    # Reward-hacking guard: pause an alias when, over the last guard_rounds rounds, the training
    # reward rose every round while every gate rejected...
    guard_rounds: int = Field(default=3, ge=2)
    # ...or when this share of a round's groups are near-identical answers...
    collapse_share: float = Field(default=0.8, gt=0.0, le=1.0)
    # ...or the round's mean answer length grew this many times over the alias's first round.
    max_length_growth: float = Field(default=3.0, gt=1.0)
    canary_check_s: float = Field(default=2.0, gt=0)
    # Each alias's rounds and canary decisions are run by one learner replica at a time: the one
    # holding the alias's Redis lease, renewed every third of this. A replica that dies frees
    # its aliases after this long; one that stalls longer loses them (its writes are fenced).
    lease_ttl_s: float = Field(default=30.0, ge=0.5, le=3600)


class ConsoleSettings(_Section):
    """`ratchet console`: the web console (console/). Its admin actions take proxy.admin_key."""

    host: str = "127.0.0.1"
    port: int = Field(default=8404, ge=1, le=65535)
    # How often an open page asks for fresh data (seconds).
    refresh_s: float = Field(default=1.0, gt=0.0, le=60.0)
    # Where the health panel asks the proxy (its /healthz, and its /metrics for Kafka). None:
    # proxy.host and proxy.port, which is right when both run on one machine.
    proxy_url: str | None = None
    # Where the overview reads the proxy's and the judge's counters (/metrics), every address
    # the name resolves to (on Kubernetes, a headless Service: every replica). None: proxy_url,
    # and judge.metrics_host and judge.metrics_port.
    proxy_metrics_url: str | None = None
    judge_metrics_url: str | None = None
    # The names browsers reach the console by (its Host header), besides loopback names, which
    # are always allowed: any other Host is refused with 400, so a page whose name rebinds to
    # the console's address (DNS rebinding) reads nothing. Host names or IP addresses, no port;
    # "*.example.com" allows subdomains; "*" allows any. Off loopback, empty: any, with a warning.
    allowed_hosts: list[str] = []
    # How long a login lasts (seconds); logout ends it at once.
    session_ttl_s: int = Field(default=12 * 3600, ge=60, le=30 * 24 * 3600)

    @field_validator("allowed_hosts")
    @classmethod
    def _host_names(cls, hosts: list[str]) -> list[str]:
        names = [host.strip().lower().removeprefix("[").removesuffix("]") for host in hosts]
        for name in names:
            if (
                name != "*"
                and not _HOST_PATTERN.match(name.removeprefix("*."))
                and not is_ip_address(name)
            ):
                raise ValueError(
                    f"{name!r} is not a host name or IP address: write it as browsers send it "
                    "in Host, without scheme or port (e.g. console.example.com, *.example.com)"
                )
        return names


DEFAULT_REDIS_URL = "redis://127.0.0.1:6399/0"
# A folder of secret files, one per setting, named as its environment variable
# (RATCHET_PROXY__API_KEYS, ...): a Kubernetes Secret mounted as a volume, so that secrets are
# not in the environment, where every process the service starts and every crash dump sees them.
SECRETS_DIR_VARIABLE = "RATCHET_SECRETS_DIR"


class RatchetSettings(BaseSettings):
    """Settings for every Ratchet service, validated once at start."""

    model_config = SettingsConfigDict(
        env_prefix="RATCHET_",
        env_nested_delimiter="__",
        extra="forbid",
    )

    kafka_bootstrap_servers: str = "127.0.0.1:9092"
    # Left at this default it names the embedded stack's Redis, which requires a password derived
    # from the secret (ratchet.secrets.redis_connection_url); a URL you set is used as given.
    redis_url: str = DEFAULT_REDIS_URL
    # Redis's password (with a username in redis_url, that user's), kept out of the URL so it
    # can come from a secret file or RATCHET_REDIS_PASSWORD; it replaces one in redis_url.
    redis_password: SecretStr | None = None
    vllm_url: str = "http://127.0.0.1:8401"
    # vLLM replicas the proxy balances across, request by request (ratchet/fleet.py: a served
    # name sticks to the replicas that hold its adapter, and spreads when it is hot; a replica
    # that fails its health check is left out until it passes). Empty: vllm_url alone.
    vllm_endpoints: list[str] = []
    # Keys API-key hashes, the held-out split and canary stickiness (ratchet/secrets.py). Every
    # replica of every service must share it; unset, the services of one machine share a random
    # one kept in state_dir.
    secret: SecretStr | None = None
    # What vLLM requires as its --api-key; unset, derived from the secret.
    vllm_api_key: SecretStr | None = None
    home: Path = Field(default_factory=default_home)
    # Defaults derive from `home` (see _derive_paths) so one variable moves everything.
    store_dir: Path | None = None
    state_dir: Path | None = None
    kafka: KafkaSettings = KafkaSettings()
    proxy: ProxySettings = ProxySettings()
    judge: JudgeSettings = JudgeSettings()
    learner: LearnerSettings = LearnerSettings()
    console: ConsoleSettings = ConsoleSettings()
    aliases: dict[str, AliasConfig] = {"support": AliasConfig()}

    @field_validator("secret", "vllm_api_key", "redis_password")
    @classmethod
    def _secret_not_blank(cls, value: SecretStr | None) -> SecretStr | None:
        # Blank (an unset environment variable) would be a secret anyone knows, and vLLM given
        # a blank key requires none at all.
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("is blank; remove it or set it to a long random value")
        return value

    @field_validator("vllm_api_key")
    @classmethod
    def _vllm_key_is_a_token(cls, value: SecretStr | None) -> SecretStr | None:
        # It travels in an "Authorization: Bearer" header: a space or line break cannot.
        if value is not None and not all(33 <= ord(c) <= 126 for c in value.get_secret_value()):
            raise ValueError("must be printable ASCII without spaces or line breaks")
        return value

    @field_validator("aliases")
    @classmethod
    def _alias_names(cls, aliases: dict[str, AliasConfig]) -> dict[str, AliasConfig]:
        for name in aliases:
            if not NAME_PATTERN.match(name):
                raise ValueError(f"alias {name!r} is not a valid name: {NAME_RULE}")
        return aliases

    @model_validator(mode="after")
    def _derive_paths(self) -> RatchetSettings:
        if self.store_dir is None:
            self.store_dir = self.home / "adapters"
        if self.state_dir is None:
            self.state_dir = self.home / "state"
        return self

    @model_validator(mode="after")
    def _heldout_pool_fits_the_gate(self) -> RatchetSettings:
        # The learner waits for gate.min_pairs held-out prompts before a round: a smaller pool
        # would make it wait forever.
        for name, alias in self.aliases.items():
            if alias.learning.enabled and alias.gate.min_pairs > self.learner.heldout_pool:
                raise ValueError(
                    f"aliases.{name}.gate.min_pairs ({alias.gate.min_pairs}) is larger than "
                    f"learner.heldout_pool ({self.learner.heldout_pool}): the gate could never "
                    "get enough held-out prompts. Raise learner.heldout_pool or lower min_pairs"
                )
        return self

    def check_proxy_exposure(self) -> None:
        """Refuse to serve the proxy without keys anywhere but loopback.

        Checked when the proxy starts, not at load: the judge and learner read the same file and
        neither need nor should be given the client keys.
        """
        if not self.proxy.api_keys and not _is_loopback(self.proxy.host):
            raise ConfigError(
                f"invalid Ratchet settings:\n  proxy.api_keys is empty while proxy.host is "
                f"{self.proxy.host!r}: running without auth is only allowed on a loopback "
                "address. Set RATCHET_PROXY__API_KEYS (a JSON list) or proxy.api_keys in "
                "ratchet.yaml, or bind to 127.0.0.1"
            )

    def check_console_exposure(self) -> None:
        """Refuse to serve the console anywhere but loopback without the admin key: its pages
        show what users asked and what the model answered, and its actions change routing."""
        if self.proxy.admin_key is None and not _is_loopback(self.console.host):
            raise ConfigError(
                f"invalid Ratchet settings:\n  proxy.admin_key is not set while console.host is "
                f"{self.console.host!r}: the console is only served without a key on a loopback "
                "address. Set RATCHET_PROXY__ADMIN_KEY or proxy.admin_key in ratchet.yaml, or "
                "bind console.host to 127.0.0.1"
            )

    @property
    def console_needs_login(self) -> bool:
        """Reading pages needs the admin key too when the console is not on loopback."""
        return not _is_loopback(self.console.host)

    @property
    def spool_dir(self) -> Path:
        assert self.state_dir is not None
        return self.state_dir / "spool"

    @property
    def auth_enabled(self) -> bool:
        return bool(self.proxy.api_keys)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        yaml_path = _config_file or config_path()
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        secrets_dir = os.environ.get(SECRETS_DIR_VARIABLE)
        if secrets_dir:
            # A folder named but missing is a broken mount: an error, not the defaults.
            sources.append(
                NestedSecretsSettingsSource(
                    file_secret_settings, secrets_dir=secrets_dir, secrets_dir_missing="error"
                )
            )
        if yaml_path.is_file():
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=yaml_path))
        return tuple(sources)


def is_ip_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def config_path() -> Path:
    return Path(os.environ.get("RATCHET_CONFIG", "ratchet.yaml"))


# The file load_settings() was asked to read; a module global rather than an environment
# variable, so loading settings has no effect on the process environment.
_config_file: Path | None = None


def settings_error_hint(exc: SettingsError) -> str:
    """pydantic-settings' message for a value a source could not read, with the fix."""
    message = str(exc)
    if "does not exist" in message or "secrets_dir" in message:
        return f"{message}: {SECRETS_DIR_VARIABLE} names the folder of secret files"
    return (
        f"{message}: a list or mapping in the environment or a secret file is JSON, "
        """e.g. RATCHET_PROXY__API_KEYS='["sk-one", "sk-two"]'"""
    )


def load_settings(path: Path | str | None = None, **overrides: Any) -> RatchetSettings:
    """Read and validate settings; raise ConfigError naming every bad setting and its fix."""
    global _config_file
    if path is not None and not Path(path).is_file():
        raise ConfigError(f"config file {path} (from --config) does not exist")
    if path is None and "RATCHET_CONFIG" in os.environ and not config_path().is_file():
        # An explicit path that names no file is a typo, not a request for the defaults.
        raise ConfigError(f"config file {config_path()} (from RATCHET_CONFIG) does not exist")
    _config_file = Path(path) if path is not None else None
    source = _config_file or config_path()
    try:
        return RatchetSettings(**overrides)
    except SettingsError as exc:  # raised by a source, before validation
        raise ConfigError(f"invalid Ratchet settings:\n  {settings_error_hint(exc)}") from None
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            if not err["loc"]:  # a rule across several settings: its message names them
                lines.append(f"  {err['msg']}")
                continue
            where = ".".join(str(part) for part in err["loc"])
            env = "RATCHET_" + "__".join(str(p).upper() for p in err["loc"] if isinstance(p, str))
            lines.append(f"  {where}: {err['msg']} (set it in {source} or {env})")
        raise ConfigError("invalid Ratchet settings:\n" + "\n".join(lines)) from None
    finally:
        # Only this call reads that file: a later RatchetSettings() must not inherit it.
        _config_file = None
