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
