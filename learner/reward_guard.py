"""The canary's reward-hacking guard, for an alias whose reward is learned from ratings: before a
promotion, does the reward model overrate the canary's rated answers more than the active
version's? One pure function, :func:`check_reward_gap`; the canary watcher reads the ratings and
the reward model's predictions around it.

It answers one of three (ratchet/reward_guard_state.py's :class:`GuardResult`):

* ``blocked``: the gap is past ``feedback.max_reward_gap`` at 95% confidence
  (learner/guard.py's :func:`reward_model_gap`): the candidate learned to please the reward
  model, not the users; the canary is rolled back and learning paused.
* ``checked``: it looked, on enough answers, and found no such gap.
* ``unchecked``: it could not look, and says why: too few raters (fewer than ``min_answers``
  capped answers on an arm), or no usable reward model. The guard used to return nothing then,
  and the promotion went through as if checked (audit N-15); now the promotion says so, and
  ``feedback.require_reward_check`` makes it a rollback instead.

What it looks at: the newest rated answers of the two versions on prompts the reward model
never trained on (its keyed held-out split: on its training ratings it fits the active
version's answers by construction, which would make any new version look overrated). Each
client holds at most ``share`` of an arm's answers, and at least one: the client, not the
rating, is the unit of evidence, so with few raters each counts once and the arm has as many
answers as raters. ``share`` is ``feedback.max_share``, and at most half ``max_reward_gap``: a
client moves an arm's mean gap by up to twice its share, so alone it cannot open the gap (a key
rating the canary 0 and the active version 1 otherwise would). The anonymous client (no API
keys: one client is all there is) is not capped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from learner.fair import per_key_cap
from learner.guard import reward_model_gap
from ratchet.records import ANONYMOUS_CLIENT
from ratchet.reward_guard_state import GuardResult
from ratchet.rewards.rated import RatedAnswer
from ratchet.rewards.reward_model import is_eval_rating
from ratchet.settings import FeedbackConfig

# The reward model's predicted rating of each answer, in order; None: no usable model.
Predict = Callable[[list[RatedAnswer]], list[float] | None]


def guard_share(feedback: FeedbackConfig) -> float:
    """The most of an arm's answers one client may hold (the module docstring)."""
    return min(feedback.max_share, feedback.max_reward_gap / 2.0)


def client_capped(answers: Sequence[RatedAnswer], share: float) -> list[RatedAnswer]:
    """The most of ``answers`` (oldest first) that can be kept with no client holding more than
    ``max(1, floor(share * kept))`` of them, each client's newest kept, in their order."""
    counts = Counter(a.owner for a in answers)

    def cap(size: int) -> int:
        return max(1, per_key_cap(size, share))

    def fits(size: int) -> bool:
        limit = cap(size)
        return sum(n if c == ANONYMOUS_CLIENT else min(n, limit) for c, n in counts.items()) >= size

    size = next((n for n in range(len(answers), 0, -1) if fits(n)), 0)
    limit = cap(size)
    taken: Counter[str] = Counter()
    kept: list[RatedAnswer] = []
    for answer in reversed(answers):
        if len(kept) == size:
            break
        if answer.owner == ANONYMOUS_CLIENT or taken[answer.owner] < limit:
            taken[answer.owner] += 1
            kept.append(answer)
    return kept[::-1]


def check_reward_gap(
    ratings: Sequence[RatedAnswer],
    active: int,
    canary: int,
    predict: Predict,
    secret: bytes,
    feedback: FeedbackConfig,
    min_answers: int,
) -> GuardResult:
    """The guard's verdict on ``canary`` against ``active`` from the alias's newest rated
    answers (oldest first, any version): ``min_answers`` capped answers are needed on each arm
    (``canary.min_feedback``)."""
    held_out = [
        a
        for a in ratings
        if a.version in (active, canary)
        and is_eval_rating(secret, a.prompt_hash, feedback.eval_fraction)
    ]
    share = guard_share(feedback)
    arms = {
        v: client_capped([a for a in held_out if a.version == v], share) for v in (active, canary)
    }
    for name, version in (("canary", canary), ("active", active)):
        kept = arms[version]
        if len(kept) < min_answers:
            raters = len({a.owner for a in kept})
            return GuardResult(
                "unchecked",
                f"could not check: too few raters ({len(kept)} < {min_answers} held-out rated "
                f"answers on the {name} arm, from {raters} raters, each counted at most "
                f"{share:g} of them)",
            )
    predicted = predict(arms[canary] + arms[active])
    if predicted is None:
        return GuardResult("unchecked", "could not check: the alias has no usable reward model")
    split = len(arms[canary])
    on_canary = [(p, a.score) for p, a in zip(predicted[:split], arms[canary], strict=True)]
    on_active = [(p, a.score) for p, a in zip(predicted[split:], arms[active], strict=True)]
    gap = reward_model_gap(on_canary, on_active, feedback.max_reward_gap, min_answers)
    if gap is not None:
        return GuardResult("blocked", gap)
    counted = [len({a.owner for a in arms[v]}) for v in (canary, active)]
    return GuardResult(
        "checked",
        f"checked on {len(arms[canary])} canary and {len(arms[active])} active held-out rated "
        f"answers from {counted[0]} and {counted[1]} raters: the reward model overrates neither "
        f"past feedback.max_reward_gap {feedback.max_reward_gap:g}",
    )
