"""What a round of training reports: its stats (:class:`RoundStats`, in each candidate's
metadata and event), each step's progress (:class:`StepProgress`, for the log and the alias's
progress) and the token-weighted sums behind them (:class:`RoundSums`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from learner.parallel import all_reduce


@dataclass(frozen=True)
class RoundStats:
    round: int  # 1-based count of rounds this adapter lineage has trained
    steps: int
    groups: int
    groups_skipped: int  # groups with all-equal rewards: no signal, not trained on
    samples: int  # samples trained on (those of the kept groups)
    mean_reward: float
    loss: float  # token mean over the round of the full loss (policy + KL)
    policy_loss: float
    kl: float | None
    ratio_mean: float
    ratio_min: float
    ratio_max: float
    clip_frac_low: float
    clip_frac_high: float
    approx_kl: float  # token mean over the round of the KL from the sampling policy (k3)
    epochs: int  # passes over the groups begun (learner.epochs_per_round at most)
    stopped: str | None  # why a later epoch ended the round early; None: every step taken
    grad_norm: float  # mean over the steps taken, before clipping
    steps_skipped: int  # steps whose gradient was not finite: no update
    completion_tokens: int  # completion tokens trained on, summed over the steps
    total_tokens: int  # prompt + completion tokens forwarded, summed over the steps
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: NaN (a round without steps) becomes None."""
        values = {**asdict(self), "tokens_per_second": self.tokens_per_second}
        return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in values.items()}


class StepResult(NamedTuple):
    loss: float  # the step's token-mean loss (NaN: not taken)
    tokens: int  # its completion tokens (0: not taken)
    stopped: str | None  # why it was not taken (epoch_stop), and the round ends


@dataclass(frozen=True)
class StepProgress:
    """What one optimizer step of a round did, for its log line and the alias's progress."""

    round: int
    step: int  # 1-based
    steps: int
    loss: float  # token mean over the step's completion tokens (policy + KL)
    reward: float  # mean reward of the step's groups' samples
    completion_tokens: int  # trained on so far in the round
    seconds: float  # since the round started (packing included)

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        return (
            f"round {self.round}: step {self.step}/{self.steps} loss {self.loss:.4f}, "
            f"reward {self.reward:.3f}, {self.tokens_per_second:.1f} tokens/s"
        )


StepCallback = Callable[[StepProgress], None]


class RoundSums:
    """Token-weighted sums of the loss stats, read once at the end (one device sync a round)."""

    _KEYS = ("policy_loss", "kl", "ratio_mean", "clip_frac_low", "clip_frac_high", "approx_kl")

    def __init__(self, device: torch.device) -> None:
        def full(value: float) -> Tensor:
            return torch.full((), value, device=device, dtype=torch.float64)

        self.sums = {k: full(0.0) for k in ("tokens", "loss", *self._KEYS)}
        self.ratio_min, self.ratio_max = full(math.nan), full(math.nan)
        self.grad_norms: list[Tensor] = []
        self.total_tokens = 0
        self.skipped = 0

    def add(self, loss: Tensor, stats: dict[str, Tensor], total_tokens: int) -> None:
        n = stats["num_tokens"].double()
        self.sums["tokens"] += n
        self.sums["loss"] += loss.double() * n
        for key in self._KEYS:
            if key in stats:
                self.sums[key] += stats[key].double() * n
        # fmin/fmax skip NaN, which is what a micro-batch without completion tokens reports
        self.ratio_min = torch.fmin(self.ratio_min, stats["ratio_min"].double())
        self.ratio_max = torch.fmax(self.ratio_max, stats["ratio_max"].double())
        self.total_tokens += total_tokens

    def reduce(self) -> None:
        """The sums over every rank's micro-batches (data parallel: learner/parallel.py)."""
        sums = all_reduce(torch.stack(list(self.sums.values())), "sum")
        self.sums = dict(zip(self.sums, sums.unbind(), strict=True))
        self.ratio_min = all_reduce(self.ratio_min, "min")
        self.ratio_max = all_reduce(self.ratio_max, "max")
        total = torch.tensor(float(self.total_tokens), dtype=torch.float64)
        self.total_tokens = int(all_reduce(total.to(self.ratio_min.device), "sum").item())

    def finish(self, *, kl_on: bool, start: float, **fields: Any) -> RoundStats:
        norm = torch.stack(self.grad_norms).double().mean() if self.grad_norms else self.ratio_min
        values = torch.stack([*self.sums.values(), self.ratio_min, self.ratio_max, norm])
        *sums_list, ratio_min, ratio_max, grad_norm = values.tolist()
        sums = dict(zip(self.sums, sums_list, strict=True))
        n = sums["tokens"]
        mean = {k: sums[k] / n if n > 0 else math.nan for k in ("loss", *self._KEYS)}
        return RoundStats(
            **fields,
            loss=mean["loss"],
            policy_loss=mean["policy_loss"],
            kl=mean["kl"] if kl_on else None,
            ratio_mean=mean["ratio_mean"],
            ratio_min=ratio_min,
            ratio_max=ratio_max,
            clip_frac_low=mean["clip_frac_low"],
            clip_frac_high=mean["clip_frac_high"],
            approx_kl=mean["approx_kl"],
            grad_norm=grad_norm if self.grad_norms else math.nan,
            steps_skipped=self.skipped,
            completion_tokens=int(n),
            total_tokens=self.total_tokens,
            seconds=time.perf_counter() - start,
        )
