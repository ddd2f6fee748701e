"""The learner's Prometheus metrics (served on learner.metrics_port, 8403 on the embedded stack)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ratchet.records import skipped_records


class LearnerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.groups = Counter(
            "ratchet_learner_groups_total",
            "Scored groups read, by what became of them (trained, duplicate, zero_spread, stale, "
            "paused, learning_disabled, overflow, unknown_alias)",
            ("alias", "outcome"),
            registry=r,
        )
        self.deferred = Counter(
            "ratchet_learner_groups_deferred_total",
            "Groups left waiting for a later round because their API key already had "
            "learning.max_key_share of the round (counted once per round that passed them over)",
            ("alias",),
            registry=r,
        )
        self.waiting = Gauge(
            "ratchet_learner_waiting_groups",
            "Usable groups waiting for the next round",
            ("alias",),
            registry=r,
        )
        self.heldout = Gauge(
            "ratchet_learner_heldout_prompts",
            "Held-out prompts available to the gate",
            ("alias",),
            registry=r,
        )
        self._add_round_metrics(r)
        self._add_progress_metrics(r)
        self._add_gate_metrics(r)
        self._add_served_metrics(r)
        self._add_release_metrics(r)
        self._add_feedback_metrics(r)
        self._add_lease_metrics(r)
        Gauge(
            "ratchet_learner_unknown_records",
            "Records skipped for unknown or invalid schema",
            registry=r,
        ).set_function(lambda: sum(skipped_records.values()))

    def _add_round_metrics(self, r: CollectorRegistry) -> None:
        """Rounds: how they ended, how long they took, and what they trained on."""
        self.rounds = Counter(
            "ratchet_learner_rounds_total",
            "Training rounds, by result (promoted, canary, rejected, failed)",
            ("alias", "result"),
            registry=r,
        )
        self.round_seconds = Histogram(
            "ratchet_learner_round_seconds",
            "Wall time of a round's phases (train, gate), and of each reward model retrain "
            "(reward_model), which waits for the round's training to end",
            ("alias", "phase"),
            buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1200, 3600),
            registry=r,
        )
        self.train_reward = Gauge(
            "ratchet_learner_train_reward_mean",
            "Mean reward of the groups the last round trained on",
            ("alias",),
            registry=r,
        )
        self.train_tokens = Counter(
            "ratchet_learner_trained_tokens_total",
            "Completion tokens trained on",
            ("alias",),
            registry=r,
        )
        self.tokens_per_second = Gauge(
            "ratchet_learner_tokens_per_second",
            "Completion tokens per second of the last round's optimizer steps",
            ("alias",),
            registry=r,
        )
        self.loss = Gauge(
            "ratchet_learner_loss", "Token-mean loss of the last round", ("alias",), registry=r
        )
        self.clip_fraction = Gauge(
            "ratchet_learner_clip_fraction",
            "Share of tokens whose ratio was clipped in the last round",
            ("alias",),
            registry=r,
        )
        self.approx_kl = Gauge(
            "ratchet_learner_approx_kl",
            "Token-mean KL of the last round's policy from the one that sampled its groups (k3)",
            ("alias",),
            registry=r,
        )
        self.epochs = Gauge(
            "ratchet_learner_epochs",
            "Passes over its groups the last round began (learner.epochs_per_round at most)",
            ("alias",),
            registry=r,
        )
        self.last_round_timestamp = Gauge(
            "ratchet_learner_last_round_timestamp_seconds",
            "When the last round finished (Unix time)",
            ("alias",),
            registry=r,
        )
        self.failures = Counter(
            "ratchet_learner_failures_total",
            "Rounds or gates that failed, by cause",
            ("alias", "cause"),
            registry=r,
        )
        self.candidate_record_errors = Counter(
            "ratchet_learner_candidate_record_errors_total",
            "Candidate records the lifecycle's outcome found in a stage it does not move from "
            "(a bookkeeping bug): overwritten, the outcome went through",
            ("alias",),
            registry=r,
        )

    def _add_progress_metrics(self, r: CollectorRegistry) -> None:
        """The running round's phase and step, as the console shows them."""
        self.round_phase = Gauge(
            "ratchet_learner_round_phase",
            "1 for the phase the alias is in (idle, waiting_heldout, train, write, gate, settle), "
            "0 for the others",
            ("alias", "phase"),
            registry=r,
        )
        self.round_step = Gauge(
            "ratchet_learner_round_step",
            "Progress within the running phase: optimizer steps done (train), pairs answered "
            "(gate); 0 between rounds",
            ("alias",),
            registry=r,
        )
        self.round_steps = Gauge(
            "ratchet_learner_round_steps",
            "What the running phase counts to: optimizer steps in the round (train), pairs drawn "
            "(gate); 0 between rounds",
            ("alias",),
            registry=r,
        )
        self.step_loss = Gauge(
            "ratchet_learner_step_loss",
            "Token-mean loss of the last optimizer step",
            ("alias",),
            registry=r,
        )
        self.progress_errors = Counter(
            "ratchet_learner_progress_errors_total",
            "Writes of the alias's progress to Redis that failed (the loop and the round go on)",
            ("alias",),
            registry=r,
        )

    def _add_served_metrics(self, r: CollectorRegistry) -> None:
        """Served equals trained: each replica's probe check and each round's drift."""
        self.served_checks = Counter(
            "ratchet_learner_served_checks_total",
            "Replicas asked for a candidate's probe before its gate, by outcome (match; "
            "mismatch: other weights than the learner's; unloaded: it could not serve it)",
            ("alias", "replica", "outcome"),
            registry=r,
        )
        self.served_distance = Gauge(
            "ratchet_learner_served_distance",
            "Mean |Δ logprob| per probe token between the learner's fingerprint of the last "
            "checked candidate and the replica's answer",
            ("alias", "replica"),
            registry=r,
        )
        self.served_drift = Gauge(
            "ratchet_learner_served_drift",
            "Mean |Δ logprob| per sampled token between vLLM's logprobs in the last round's "
            "groups and the learner's under the weights that served them, per replica that "
            "sampled them (unknown: groups from before they named it)",
            ("alias", "replica"),
            registry=r,
        )
        self.served_drift_version = Gauge(
            "ratchet_learner_served_drift_version",
            "The version whose groups ratchet_learner_served_drift was measured on",
            ("alias",),
            registry=r,
        )
        self.served_drift_limit = Gauge(
            "ratchet_learner_served_drift_limit",
            "The tolerance ratchet_learner_served_drift is held to (learner.served_check)",
            ("alias",),
            registry=r,
        )

    def _add_gate_metrics(self, r: CollectorRegistry) -> None:
        """The gate: its judge calls and the candidate's win rate against the live version."""
        self.gate_replica_ejections = Counter(
            "ratchet_learner_gate_replica_ejections_total",
            "Times the gate ejected a vLLM replica for failing its requests in a row "
            "(proxy.outlier_ejection, as the proxy's ratchet_proxy_endpoint_ejections)",
            ("replica",),
            registry=r,
        )
        self.gate_judge_calls = Counter(
            "ratchet_learner_gate_judge_calls_total",
            "Judge-model calls the gate made (RULER-judged aliases)",
            ("alias",),
            registry=r,
        )
        self.gate_judge_cost = Counter(
            "ratchet_learner_gate_judge_cost_usd_total",
            "Price of the gate's judge calls in USD, from litellm's price map",
            ("alias",),
            registry=r,
        )
        self.gate_win_rate = Gauge(
            "ratchet_learner_gate_win_rate",
            "Win rate of the last gated candidate against the live version",
            ("alias",),
            registry=r,
        )
        self.gate_ci_low = Gauge(
            "ratchet_learner_gate_win_rate_ci_low",
            "Lower end of the last gate's 95% interval",
            ("alias",),
            registry=r,
        )

    def _add_release_metrics(self, r: CollectorRegistry) -> None:
        """Versions and canaries: what is live, how the canary fares, rollbacks and pauses."""
        self.active_version = Gauge(
            "ratchet_learner_active_version", "The live version", ("alias",), registry=r
        )
        self.canary_version = Gauge(
            "ratchet_learner_canary_version",
            "The version on canary (0: none)",
            ("alias",),
            registry=r,
        )
        self.canary_requests = Gauge(
            "ratchet_learner_canary_requests",
            "Requests counted for the running canary, by arm",
            ("alias", "arm"),
            registry=r,
        )
        self.canary_rating_pairs = Gauge(
            "ratchet_learner_canary_rating_pairs",
            "Clients on each arm at the last look of the running canary's test over clients "
            "(learner/canary_clients.py; 0 before its first look)",
            ("alias",),
            registry=r,
        )
        self.canary_rating_evidence = Gauge(
            "ratchet_learner_canary_rating_evidence",
            "How far the last look's lower bound on the canary's trimmed mean rating minus the "
            "active arm's is above -canary.max_feedback_drop (it promotes above 0)",
            ("alias",),
            registry=r,
        )
        self.canary_ratings_unmatched = Counter(
            "ratchet_learner_canary_ratings_unmatched_total",
            "Ratings given up on while a canary ran because their answer was not read within "
            "60 s (expired: an answer from before the canary, or lost) or too many waited "
            "(overflow)",
            ("reason",),
            registry=r,
        )
        self.canary_error_rate = Gauge(
            "ratchet_learner_canary_error_rate",
            "Server error rate of each arm during the running canary",
            ("alias", "arm"),
            registry=r,
        )
        self.rollbacks = Counter(
            "ratchet_learner_rollbacks_total",
            "Versions rolled back, by reason (error_rate, feedback, manual)",
            ("alias", "reason"),
            registry=r,
        )
        self.paused = Gauge(
            "ratchet_learner_paused",
            "1 while learning for the alias is paused, with the reason",
            ("alias", "reason"),
            registry=r,
        )

    def _add_feedback_metrics(self, r: CollectorRegistry) -> None:
        """Feedback aliases: the join of ratings to answers, and the reward model."""
        self.ratings_joined = Counter(
            "ratchet_learner_ratings_joined_total",
            "Traffic and feedback records of feedback aliases by what the join made of them: "
            "stored (an answer awaiting its rating), pending (a rating awaiting its answer), "
            "joined, duplicate, wrong_key, no_answer",
            ("outcome",),
            registry=r,
        )
        self.reward_model_auc = Gauge(
            "ratchet_learner_reward_model_auc",
            "Held-out AUC of the alias's newest reward model",
            ("alias",),
            registry=r,
        )
        self.reward_model_auc_low = Gauge(
            "ratchet_learner_reward_model_auc_low",
            "Lower end of that AUC's 95% interval (the model gives rewards only while it is "
            "above feedback.min_auc)",
            ("alias",),
            registry=r,
        )
        self.reward_model_version = Gauge(
            "ratchet_learner_reward_model_version",
            "The alias's newest reward model version (0: none)",
            ("alias",),
            registry=r,
        )

    def _add_lease_metrics(self, r: CollectorRegistry) -> None:
        """The alias's lease (learner/leases.py): held, waited for, lost."""
        self.lease_held = Gauge(
            "ratchet_learner_lease_held",
            "1 while this learner holds the alias's lease (running a round or deciding its "
            "canary); across replicas at most one reports 1 per alias",
            ("alias",),
            registry=r,
        )
        self.lease_waits = Counter(
            "ratchet_learner_lease_busy_total",
            "Times a round or canary decision waited because another learner held the alias's "
            "lease, by what waited (round, canary)",
            ("alias", "what"),
            registry=r,
        )
        self.lease_lost = Counter(
            "ratchet_learner_lease_lost_total",
            "Rounds or canary decisions abandoned because the alias's lease was lost mid-way "
            "(the learner stalled past learner.lease_ttl_s, or Redis lost the key)",
            ("alias", "what"),
            registry=r,
        )
