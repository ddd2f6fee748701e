"""The learned reward model: what users' ratings say about an answer, as a score in [0, 1].

Shared by the learner, which trains it on rated exchanges, and the judge and the gate, which score
answers with it. A version is immutable, in the adapter store as ``<alias>.reward@v<N>/``
(:data:`HEAD_FILE` and ``ratchet.json`` with its training counts and held-out metrics).

The model. The base model, frozen, reads the prompt and the answer; the answer's hidden states at
two thirds of its depth (:data:`FEATURE_DEPTH`; the layers above are never run) give two feature
vectors, their mean over the answer's tokens and the last token's, and a linear head on those
(standardised) gives a logit ``z``; the predicted rating is ``sigmoid(z)``.
Every answer of a group is read in ONE forward pass with the prompt computed once
(ratchet/rewards/packing.py), so scoring a group of K costs one pass over the prompt and the K
answers. Only the head (2 x hidden + 1 weights) is trained, on features computed once per rating:
seconds on a CPU, where training the base too would cost minutes per retrain and overfit a few
hundred ratings.

The loss, over ratings ``y_i`` in [0, 1] (thumbs: 0 or 1) with logits ``z_i``::

    L = mean_i BCE(sigmoid(z_i), y_i)                                  (pointwise)
      + mean_{(i, j): same prompt, y_i > y_j} -log sigmoid(z_i - z_j)  (pairwise, Bradley-Terry)
      + l2 * |w|^2

The pairwise term uses what several ratings of one prompt say beyond their levels: which answer
the users preferred. ``l2`` is chosen at each retrain (:func:`choose_l2`): by cross-validation over
the training ratings' prompts, from :data:`L2_GRID`.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ratchet.rewards.rated import RatedAnswer
from ratchet.rewards.reward_status import RewardStatus, reward_model_name, reward_store_name
from ratchet.secrets import keyed_hash

HEAD_FILE = "reward_head.safetensors"
# Where the features are read, as a share of the decoder's layers: the last layers serve the next
# token, the middle ones hold more of what the text is. Measured (bench/reward_model_quality.py,
# SmolLM2-135M-Instruct, sampled answers rated by a task's rule plus N(0, 0.1)): the AUC against
# the rule on unseen prompts, from 160 prompts' ratings, L2 chosen, 0.79 from the last layer and
# 0.84 from layer 20 of 30 on the bulleted task; 0.74 and 0.77 on sorting. Bounded by the layers.
FEATURE_DEPTH = 2 / 3
# What a head was trained on, in its file: a head reads only the features it was fitted to (a
# version trained before FEATURE_DEPTH changed is refused, and its alias waits for a retrain).
FEATURES = f"base model layers 0-{FEATURE_DEPTH:.3f} of depth; answer mean and last token"
# The head's L2 strengths cross-validation chooses from (the features are standardised). The fixed
# 1e-3 of before overfit: the same measurement gave 0.67 and 0.65 at 1e-3, and the strength chosen
# moved with the ratings there were (4.3 from 40 prompts, 2 from 160), so each retrain chooses.
L2_GRID = (0.1, 0.3, 1.0, 3.0, 10.0)
L2_FOLDS = 3
# The ratings the choice is made on (the first given: the trainer passes the newest first). Three
# folds of five strengths are 15 fits: 9 s at 2,400 ratings on two cores, more with more ratings.
L2_RATINGS = 4000
POSITIVE = 0.5  # a thumbs up: a rating at or above this is a good one (good_ratings)


def is_eval_rating(secret: bytes, prompt_hash: str, fraction: float) -> bool:
    """Whether a rating is kept out of training, to evaluate the model: decided by its prompt,
    so answers to one prompt stay together (the pairwise accuracy needs them) and every retrain
    splits alike. Keyed with the server secret: a client who could compute the split could
    choose prompts that land in the evaluation set and so confirm whatever it taught."""
    digest = keyed_hash(secret, "reward-eval", prompt_hash)
    return int(digest[:16], 16) / 2**64 < fraction


# --- metrics (pure) ------------------------------------------------------------------------------


def good_ratings(scores: Sequence[float]) -> list[bool] | None:
    """Which ratings count as good (a model trains only on sets with both kinds): a thumbs up
    (at least :data:`POSITIVE`) when
    ratings fall on both sides of it; else, for users who rate on a scale and never reach it (or
    never fall below it), those above the ratings' mean. None when every rating is the same."""
    if any(s >= POSITIVE for s in scores) and any(s < POSITIVE for s in scores):
        return [s >= POSITIVE for s in scores]
    mean = float(np.mean(scores)) if len(scores) else 0.0
    good = [s > mean for s in scores]
    return good if any(good) and not all(good) else None


# Rows of the pair matrix compared at a time: bounds the memory of a large held-out set.
CONCORDANCE_ROWS = 512


def auc(predictions: Sequence[float], scores: Sequence[float]) -> float | None:
    """The chance that, of two rated answers whose ratings differ, ``predictions`` rank the
    higher-rated one higher (ties in prediction count half); None without two different ratings.

    For thumbs (0 and 1) this is the AUC. For ratings on a scale it is the AUC's generalisation
    (Harrell's concordance): every pair of different ratings counts, not only pairs across a cut
    at :data:`POSITIVE`. A cut measured what a handful of ratings above it said: on the bulleted
    task most answers score 0.25 and a good one is rare, and issue 35's defaults run saw the
    cut's AUC go 0.46, 0.96, 0.80, 0.12 over four retrains on 12-59 held-out ratings."""
    p = np.asarray(predictions, dtype=float)
    s = np.asarray(scores, dtype=float)
    concordant, pairs = 0.0, 0
    for start in range(0, len(s), CONCORDANCE_ROWS):
        rows_p = p[start : start + CONCORDANCE_ROWS, None]
        higher = s[start : start + CONCORDANCE_ROWS, None] > s[None, :]  # row rated above column
        pairs += int(higher.sum())
        concordant += float((higher & (rows_p > p[None, :])).sum())
        concordant += 0.5 * float((higher & (rows_p == p[None, :])).sum())
    return concordant / pairs if pairs else None


def preference_pairs(answers: Sequence[RatedAnswer]) -> list[tuple[int, int]]:
    """(better, worse) indices of answers to the same prompt with different ratings."""
    by_prompt: dict[str, list[int]] = {}
    for i, answer in enumerate(answers):
        by_prompt.setdefault(answer.prompt_hash, []).append(i)
    pairs = []
    for indices in by_prompt.values():
        for a in indices:
            for b in indices:
                if answers[a].score > answers[b].score:
                    pairs.append((a, b))
    return pairs


def pairwise_accuracy(
    predictions: Sequence[float], pairs: Sequence[tuple[int, int]]
) -> float | None:
    if not pairs:
        return None
    return float(
        sum(
            1.0
            if predictions[a] > predictions[b]
            else 0.5
            if predictions[a] == predictions[b]
            else 0.0
            for a, b in pairs
        )
        / len(pairs)
    )


def bootstrap_metric(
    predictions: Sequence[float],
    scores: Sequence[float],
    samples: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the AUC (:func:`auc`), resampling ratings with
    replacement."""
    rng = np.random.default_rng(seed)
    n = len(predictions)
    if n == 0:
        return None
    pred, y = np.asarray(predictions), np.asarray(scores)
    values = []
    for _ in range(samples):
        pick = rng.integers(0, n, size=n)
        value = auc(pred[pick].tolist(), y[pick].tolist())
        if value is not None:
            values.append(value)
    if not values:
        return None
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(values, [tail, 1.0 - tail])
    return float(low), float(high)


@dataclass(frozen=True)
class Evaluation:
    """The reward model on ratings it never trained on."""

    ratings: int
    auc: float | None
    auc_interval: tuple[float, float] | None
    pairs: int
    pairwise_accuracy: float | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "ratings": self.ratings,
            "auc": self.auc,
            "auc_interval": list(self.auc_interval) if self.auc_interval else None,
            "pairs": self.pairs,
            "pairwise_accuracy": self.pairwise_accuracy,
        }


def evaluate(predictions: Sequence[float], answers: Sequence[RatedAnswer]) -> Evaluation:
    scores = [a.score for a in answers]
    pairs = preference_pairs(answers)
    return Evaluation(
        ratings=len(answers),
        auc=auc(predictions, scores),
        auc_interval=bootstrap_metric(predictions, scores),
        pairs=len(pairs),
        pairwise_accuracy=pairwise_accuracy(predictions, pairs),
    )


# --- the head (torch) ----------------------------------------------------------------------------


@dataclass
class RewardHead:
    """A linear head on standardised features: ``z = w . (f - mean) / std + b``."""

    weight: Any  # torch.Tensor (F,)
    bias: float
    mean: Any  # torch.Tensor (F,)
    std: Any  # torch.Tensor (F,)

    def logits(self, features: Any) -> Any:
        return ((features - self.mean) / self.std) @ self.weight + self.bias

    def predict(self, features: Any) -> list[float]:
        import torch

        with torch.no_grad():
            return torch.sigmoid(self.logits(features)).tolist()

    def save(self, folder: Path) -> None:
        import torch
        from safetensors.torch import save_file

        tensors = {
            "weight": self.weight.detach().contiguous(),
            "bias": torch.tensor([self.bias]),
            "mean": self.mean.contiguous(),
            "std": self.std.contiguous(),
        }
        save_file(tensors, str(folder / HEAD_FILE), metadata={"features": FEATURES})

    @classmethod
    def load(cls, folder: Path) -> RewardHead:
        """The head in ``folder``; ValueError when it was trained on other features."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        path = str(folder / HEAD_FILE)
        with safe_open(path, framework="pt") as f:
            trained_on = (f.metadata() or {}).get(
                "features", "the last layer (before features were named)"
            )
        if trained_on != FEATURES:
            raise ValueError(
                f"{folder.name} was trained on other features ({trained_on}): retrain it"
            )
        t = load_file(path)
        return cls(weight=t["weight"], bias=float(t["bias"][0]), mean=t["mean"], std=t["std"])


def reward_loss(
    logits: Any, scores: Any, pairs: Sequence[tuple[int, int]], weight: Any, l2: float
) -> Any:
    """The loss of the module docstring on one fixed batch (tested on a fixed set)."""
    import torch
    import torch.nn.functional as F

    loss = F.binary_cross_entropy_with_logits(logits, scores)
    if pairs:
        better = torch.tensor([a for a, _ in pairs])
        worse = torch.tensor([b for _, b in pairs])
        loss = loss - F.logsigmoid(logits[better] - logits[worse]).mean()
    return loss + l2 * (weight**2).sum()


def fit_head(
    features: Any,
    answers: Sequence[RatedAnswer],
    *,
    l2: float,
    steps: int = 200,
    seed: int = 0,
) -> RewardHead:
    """Train the head on (features, ratings): full-batch L-BFGS, deterministic given the seed."""
    import torch

    if len(answers) != features.shape[0]:
        raise ValueError(f"{features.shape[0]} feature rows for {len(answers)} ratings")
    features = features.detach().double()
    mean = features.mean(dim=0)
    std = features.std(dim=0, unbiased=False).clamp(min=1e-6)
    x = (features - mean) / std
    y = torch.tensor([a.score for a in answers], dtype=torch.float64)
    pairs = preference_pairs(answers)
    generator = torch.Generator().manual_seed(seed)
    weight = (
        torch.randn(x.shape[1], generator=generator, dtype=torch.float64) * 1e-3
    ).requires_grad_()
    prior = min(max(float(y.mean()), 1e-3), 1 - 1e-3)
    bias = torch.tensor(math.log(prior / (1 - prior)), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS(
        [weight, bias], lr=1.0, max_iter=steps, line_search_fn="strong_wolfe"
    )

    def closure() -> Any:
        optimizer.zero_grad()
        loss = reward_loss(x @ weight + bias, y, pairs, weight, l2)
        loss.backward()
        return loss

    optimizer.step(closure)  # type: ignore[no-untyped-call]
    return RewardHead(
        weight=weight.detach().float(),
        bias=float(bias.detach()),
        mean=mean.float(),
        std=std.float(),
    )


def prompt_folds(answers: Sequence[RatedAnswer], folds: int) -> list[list[int]]:
    """Indices of ``answers`` in ``folds`` sets, each prompt's answers in one (a fold's prompts
    are unseen by the others, as the held-out set's are); the same answers split alike."""
    prompts = sorted({a.prompt_hash for a in answers})
    fold_of = {prompt: i % folds for i, prompt in enumerate(prompts)}
    out: list[list[int]] = [[] for _ in range(folds)]
    for i, answer in enumerate(answers):
        out[fold_of[answer.prompt_hash]].append(i)
    return out


def fold_trials(
    features: Any, answers: Sequence[RatedAnswer], split: Sequence[Sequence[int]]
) -> list[tuple[Any, list[RatedAnswer], Any, list[float]]]:
    """Per fold of ``split`` held out: (the other folds' features and answers, the fold's
    features and scores), built once for every strength tried; a fold whose rest holds no
    usable ratings is left out."""
    trials = []
    for held in split:
        held_set = set(held)
        rest = [i for i in range(len(answers)) if i not in held_set]
        if good_ratings([answers[i].score for i in rest]) is None:
            continue
        trials.append(
            (
                features[rest],
                [answers[i] for i in rest],
                features[list(held)],
                [answers[i].score for i in held],
            )
        )
    return trials


def choose_l2(
    features: Any,
    answers: Sequence[RatedAnswer],
    grid: Sequence[float] = L2_GRID,
    folds: int = L2_FOLDS,
    limit: int = L2_RATINGS,
) -> tuple[float, dict[float, float | None]]:
    """(the L2 strength of ``grid`` whose heads rank unseen prompts' ratings best, each
    strength's mean held-out AUC over the folds), on the first ``limit`` answers. Each fold is
    held out in turn, a head is fitted on the rest; a tie goes to the stronger L2 (the simpler
    head). With fewer prompts than folds, or no fold that can be scored, the middle of the grid."""
    middle = sorted(grid)[len(grid) // 2]
    features, answers = features[:limit], answers[:limit]
    split = [fold for fold in prompt_folds(answers, folds) if fold]
    if len(split) < 2:
        return middle, {}
    trials = fold_trials(features, answers, split)
    scores: dict[float, float | None] = {}
    for l2 in sorted(grid):
        aucs = []
        for train_features, train_answers, held_features, held_scores in trials:
            head = fit_head(train_features, train_answers, l2=l2)
            value = auc(head.predict(held_features), held_scores)
            if value is not None:
                aucs.append(value)
        scores[l2] = float(np.mean(aucs)) if aucs else None
    scored = [(value, l2) for l2, value in scores.items() if value is not None]
    if not scored:
        return middle, scores
    return max(scored)[1], scores


# --- features: the frozen base model reads (prompt, answers) --------------------------------------


def feature_backbone(backbone: Any, depth: float = FEATURE_DEPTH) -> Any:
    """The decoder cut to its first ``depth`` of layers (at least one): its output (after the
    final norm) is then the features' layer, and the layers above cost nothing. A backbone whose
    layers are not one ``layers`` list is used whole."""
    import torch

    layers = getattr(backbone, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        return backbone
    keep = max(1, round(depth * len(layers)))
    backbone.layers = torch.nn.ModuleList(list(layers)[:keep])
    return backbone


class AnswerFeatures:
    """The frozen base model's features of answers to a prompt, a group in one forward pass."""

    def __init__(
        self, base_model_path: Path, max_tokens: int = 2048, depth: float = FEATURE_DEPTH
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(base_model_path)
        model = AutoModelForCausalLM.from_pretrained(
            base_model_path, dtype=torch.float32, attn_implementation="sdpa"
        )
        self.backbone = feature_backbone(getattr(model, model.base_model_prefix).eval(), depth)
        self.max_tokens = max_tokens
        self.size = 2 * int(model.config.hidden_size)

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def answer_ids(self, answer: str) -> list[int]:
        ids = self.tokenizer(answer, add_special_tokens=False)["input_ids"]
        return list(ids) or [int(self.tokenizer.eos_token_id or 0)]

    def group(self, messages: list[dict[str, Any]], answers: Sequence[str]) -> Any:
        """(K, F) features of K answers to one prompt: one forward pass, the prompt once."""
        import torch

        from ratchet.rewards.packing import pack_shared_prompt, shared_prompt_mask

        prompt = self.prompt_ids(messages)
        answer_ids = [self.answer_ids(a) for a in answers]
        # Bound a row: the prompt's head is kept (the instruction), and each answer's start.
        budget = max(16, (self.max_tokens - min(len(prompt), self.max_tokens // 2)) // len(answers))
        prompt = prompt[: self.max_tokens // 2]
        answer_ids = [ids[:budget] for ids in answer_ids]
        rows = pack_shared_prompt([prompt], [answer_ids])
        with torch.no_grad():
            hidden = self.backbone(
                input_ids=rows.input_ids,
                attention_mask=shared_prompt_mask(rows.segment_ids),
                position_ids=rows.position_ids,
                use_cache=False,
            ).last_hidden_state[0]
        out = []
        for k, end in enumerate(rows.answer_ends[0]):
            start = end - len(answer_ids[k]) + 1
            out.append(torch.cat([hidden[start : end + 1].mean(dim=0), hidden[end]]))
        return torch.stack(out)

    def rated(self, answers: Sequence[RatedAnswer]) -> Any:
        """(N, F) features of rated answers, those to one prompt read together."""
        import torch

        by_prompt: dict[str, list[int]] = {}
        for i, a in enumerate(answers):
            by_prompt.setdefault(a.prompt_hash, []).append(i)
        out = torch.zeros((len(answers), self.size))
        for indices in by_prompt.values():
            first = answers[indices[0]]
            feats = self.group(first.prompt_messages, [answers[i].text for i in indices])
            out[indices] = feats
        return out


def write_meta(
    evaluation: Evaluation,
    trained: int,
    keys: int,
    base_model: str,
    l2: float,
    l2_scores: Mapping[float, float | None],
) -> dict[str, Any]:
    return {
        "kind": "reward_model",
        "base_model": base_model,
        "features": FEATURES,
        "trained_on": {"ratings": trained, "keys": keys},
        "l2": l2,
        # each strength tried: its mean AUC on the cross-validation's held-out folds
        "l2_cross_validated": {repr(k): v for k, v in l2_scores.items()},
        "heldout": evaluation.to_dict(),
    }


def missing_packages() -> list[str]:
    """What scoring with a reward model needs and this install lacks: the learner extra and torch
    bring them, the judge extra does not."""
    needed = ("torch", "transformers", "safetensors")
    return [name for name in needed if importlib.util.find_spec(name) is None]


class RewardModelUnavailable(Exception):
    """No reward model of the alias may give rewards yet (none trained, or its AUC too low)."""


class RewardModels:
    """Score answers with an alias's live reward model. The base model is loaded once, on first
    use; each version's head is read from the store once."""

    def __init__(
        self, store_root: Path, base_model_path: Path, features: AnswerFeatures | None = None
    ) -> None:
        self.store_root = store_root
        self.base_model_path = base_model_path
        self._features = features  # given: shared with whatever else reads the same base model
        self._heads: dict[tuple[str, int], RewardHead] = {}

    @property
    def features(self) -> AnswerFeatures:
        if self._features is None:
            self._features = AnswerFeatures(self.base_model_path)
        return self._features

    def head(self, alias: str, version: int) -> RewardHead:
        key = (alias, version)
        if key not in self._heads:
            folder = self.store_root / f"{reward_store_name(alias)}@v{version}"
            self._heads[key] = RewardHead.load(folder)
        return self._heads[key]

    def score(
        self,
        alias: str,
        status: RewardStatus | None,
        messages: list[dict[str, Any]],
        answers: Sequence[str],
    ) -> tuple[list[float], str]:
        """(each answer's predicted rating, the model's name); answers of one prompt are read in
        one forward pass. RewardModelUnavailable when the alias has no usable model."""
        if status is None:
            raise RewardModelUnavailable(f"{alias} has no reward model yet")
        if not status.usable:
            raise RewardModelUnavailable(
                f"{alias}'s reward model v{status.version}: {status.reason}"
            )
        try:
            head = self.head(alias, status.version)
        except ValueError as exc:  # trained on other features: the learner retrains it
            raise RewardModelUnavailable(str(exc)) from exc
        return head.predict(self.features.group(messages, answers)), reward_model_name(
            alias, status.version
        )
