"""The judge's Prometheus metrics (served on judge.metrics_port)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ratchet.records import skipped_records


class JudgeMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.groups = Counter(
            "ratchet_judge_groups_total", "Scored groups produced", ("alias",), registry=r
        )
        self.heldout = Counter(
            "ratchet_judge_heldout_total", "Prompts set aside for the gate", ("alias",), registry=r
        )
        self.skipped = Counter(
            "ratchet_judge_skipped_total",
            "Traffic records not turned into a group, by reason",
            ("alias", "reason"),
            registry=r,
        )
        self.failures = Counter(
            "ratchet_judge_failures_total",
            "Groups dropped after sampling or scoring failed, by cause",
            ("alias", "cause"),
            registry=r,
        )
        self.judge_latency = Histogram(
            "ratchet_judge_call_seconds",
            "Latency of one judge-model call",
            ("alias",),
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=r,
        )
        self.sample_latency = Histogram(
            "ratchet_judge_sampling_seconds",
            "Latency of sampling one group from vLLM",
            ("alias",),
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=r,
        )
        self._add_spend_metrics(r)
        self._add_reward_metrics(r)
        self._add_agreement_metrics(r)
        self.in_flight = Gauge(
            "ratchet_judge_in_flight_groups", "Groups being worked on", registry=r
        )
        self.replica_ejections = Counter(
            "ratchet_judge_replica_ejections_total",
            "Times the judge's sampling ejected a vLLM replica for failing its requests in a row "
            "(proxy.outlier_ejection, as the proxy's ratchet_proxy_endpoint_ejections)",
            ("replica",),
            registry=r,
        )
        Gauge(
            "ratchet_judge_unknown_records",
            "Records skipped for unknown or invalid schema",
            registry=r,
        ).set_function(lambda: sum(skipped_records.values()))

    def _add_spend_metrics(self, r: CollectorRegistry) -> None:
        """The bill (ratchet/bill.py): what judging and sampling spend, failed calls included."""
        self.judge_calls = Counter(
            "ratchet_judge_model_calls_total",
            "Judge-model calls made, failed ones included",
            ("alias",),
            registry=r,
        )
        self.judge_seconds = Counter(
            "ratchet_judge_model_seconds_total",
            "Seconds spent in judge-model calls, failed ones included",
            ("alias",),
            registry=r,
        )
        self.judge_tokens = Counter(
            "ratchet_judge_model_tokens_total",
            "Tokens of judge-model calls, by kind (input, output)",
            ("alias", "kind"),
            registry=r,
        )
        self.judge_cost = Counter(
            "ratchet_judge_model_cost_usd_total",
            "Price of judge-model calls in USD, from litellm's price map (0 for local models)",
            ("alias",),
            registry=r,
        )
        self.sampled_tokens = Counter(
            "ratchet_judge_sampled_tokens_total",
            "Tokens of the groups sampled from vLLM, by kind (input: prompt, output: answers)",
            ("alias", "kind"),
            registry=r,
        )

    def _add_reward_metrics(self, r: CollectorRegistry) -> None:
        """The rewards the judge gives, and the groups whose scores it did not have to ask for."""
        self.cache_hits = Counter(
            "ratchet_judge_cache_hits_total",
            "Groups whose scores came from the Redis cache",
            ("alias",),
            registry=r,
        )
        self.zero_variance = Counter(
            "ratchet_judge_zero_variance_total",
            "Groups whose rewards are all equal",
            ("alias",),
            registry=r,
        )
        self.reward = Histogram(
            "ratchet_judge_reward",
            "Rewards of produced samples",
            ("alias",),
            buckets=tuple(i / 10 for i in range(11)),
            registry=r,
        )
        self.reward_mean = Gauge(
            "ratchet_judge_reward_mean", "Mean reward of the last group", ("alias",), registry=r
        )
        self.reward_spread = Gauge(
            "ratchet_judge_reward_spread",
            "Reward standard deviation of the last group",
            ("alias",),
            registry=r,
        )

    def _add_agreement_metrics(self, r: CollectorRegistry) -> None:
        """Judge-user agreement (judge/agreement.py, ratchet/rewards/agreement.py)."""
        self.agreement = Gauge(
            "ratchet_judge_user_agreement",
            "How far the judge's scores of rated served answers agree with the users' ratings",
            ("alias", "measure"),
            registry=r,
        )
        self.agreement_pairs = Gauge(
            "ratchet_judge_user_agreement_pairs",
            "Rated answers the judge scored, in the agreement window",
            ("alias",),
            registry=r,
        )
        self.agreement_min = Gauge(
            "ratchet_judge_user_agreement_min",
            "feedback.min_agreement: the pairwise accuracy below which the alert fires",
            ("alias",),
            registry=r,
        )
        self.agreement_min_pairs = Gauge(
            "ratchet_judge_user_agreement_min_pairs",
            "feedback.agreement_min_pairs: rated answers scored before the alert may fire",
            ("alias",),
            registry=r,
        )
        self.agreement_probes = Counter(
            "ratchet_judge_agreement_probes_total",
            "Rated served answers taken for the agreement, by outcome (scored, or why not)",
            ("alias", "outcome"),
            registry=r,
        )
