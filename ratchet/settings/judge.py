"""The ``judge`` section: how groups are sampled and scored."""

from __future__ import annotations

from pydantic import (
    Field,
    SecretStr,
)

from ratchet.settings.base import (
    _Section,
)


class JudgeSettings(_Section):
    consumer_group: str = Field(
        default="ratchet-judge",
        description="Kafka consumer group of the judge replicas.",
    )
    metrics_host: str = Field(
        default="127.0.0.1",
        description="Address of the judge's /metrics.",
    )
    metrics_port: int = Field(
        default=8402,
        ge=1,
        le=65535,
        description="Port of the judge's /metrics.",
    )
    concurrency: int = Field(
        default=4,
        ge=1,
        le=256,
        description=(
            "Groups sampled and judged at once; the judge model and vLLM see this many calls in "
            "flight. On a small CPU machine, past 4 a group only waits longer "
            "(docs/results/settings-measurements.md). A GPU vLLM batches far more: raise it "
            "there."
        ),
    )
    poll_records: int = Field(
        default=16,
        ge=1,
        description="Traffic records read from Kafka per poll.",
    )
    judge_api_base: str | None = Field(
        default=None,
        description=(
            "Where litellm reaches the judge model; empty means the embedded vLLM (vllm_url + /v1)."
        ),
    )
    judge_api_key: SecretStr | None = Field(
        default=None,
        description="API key of the judge model's provider (better from a secret file).",
    )
    judge_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="How long one call to the judge model may take.",
    )
    judge_retries: int = Field(
        default=3,
        ge=0,
        description="Retries of a failed call to the judge model.",
    )
    judge_max_tokens: int = Field(
        default=1024,
        ge=16,
        description="Most tokens the judge model may answer with.",
    )
    cache_ttl_s: int = Field(
        default=7 * 24 * 3600,
        ge=1,
        description="How long the judge's scores are cached in Redis (seconds).",
    )
    cache_max_entries: int = Field(
        default=100_000,
        ge=100,
        description=(
            "Most groups' scores the judge keeps cached (ratchet:judge:cache:*, a few hundred "
            "bytes to a few KiB each, indexed in ratchet:judge:cache-index); past it the oldest "
            "entries are dropped: a miss judges the group again, never a wrong score."
        ),
    )
    sample_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="How long sampling one group from vLLM may take.",
    )
    done_ttl_s: int = Field(
        default=3600,
        ge=0,
        le=30 * 24 * 3600,
        description=(
            "A traffic record whose outputs Kafka acknowledged is marked judged in Redis until "
            "its batch's offsets are committed (then deleted), or for this long when the commit "
            "fails, so the judge replica that re-reads an uncommitted batch (after a crash or a "
            "rebalance) skips it instead of judging it twice. 0 turns the marks off."
        ),
    )
    max_pending_rounds: int = Field(
        default=2,
        ge=0,
        description=(
            "Backpressure: sample for an alias only while fewer than this many rounds' groups (x "
            "learner.batch_groups) are produced and not yet trained on. 0: no bound. Without one "
            "the judge samples far ahead of what a round needs "
            "(docs/results/settings-measurements.md)."
        ),
    )
    pause_while_training: bool = Field(
        default=False,
        description=(
            "Don't sample while the alias's round trains, writes or is gated: right where vLLM "
            "and the learner share cores (a round trains many times slower beside sampling: "
            "docs/results/settings-measurements.md; the gate's answers take vLLM), and the groups "
            "sampled after the gate come from where the next round starts; off where the learner "
            "has hardware of its own."
        ),
    )
