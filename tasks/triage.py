"""A classification task: which team a customer's support message goes to, the label alone.

The prompt is one user turn: the instruction, which names the five teams, then ``Message: ``
and a short message (a greeting, what went wrong, which order, a closing; seeded). Each team
has its own phrasings of what went wrong, and no message names a team: the model has to read
the problem (being charged twice is billing, a parcel stuck in transit is shipping). The
verifier (:func:`triage_reward`, ``"tasks.triage:triage_reward"``) finds the problem's
phrasing in the message and so its team. Production traffic is full of such routing and
labelling calls: a content task, where the answer is short and either right or wrong.
"""

from __future__ import annotations

import random
import re
from typing import Any

from tasks.common import prompt_loader, task_data, user_turn

__all__ = [
    "PROBLEMS",
    "TEAMS",
    "expected_team",
    "generate_prompts",
    "load_prompts",
    "triage_reward",
]

DEFAULT_COUNT = 480
DEFAULT_SEED = 20251127
TEAMS = ("billing", "shipping", "technical", "account", "returns")
INSTRUCTION = (
    "Which team should handle this support message: billing, shipping, technical, account or "
    "returns? Reply with the team's name only."
)
MARKER = "\n\nMessage: "
ALONE = 1.0  # the right team and nothing else
WITH_TEXT = 0.6  # the right team, and no other, inside more words

PROBLEMS: dict[str, tuple[str, ...]] = {
    "billing": (
        "I was charged twice for the same purchase.",
        "My card statement shows an amount I never agreed to pay.",
        "The invoice lists a price higher than the one on your website.",
        "You took money from my card after I had cancelled the subscription.",
        "The discount code was accepted but the total did not go down.",
        "I need a copy of the receipt with my company's tax number on it.",
        "My bank says your payment failed, yet the money is gone.",
        "I was billed for the premium plan although I am on the basic one.",
    ),
    "shipping": (
        "The parcel has been stuck in transit for nine days.",
        "The tracking page has not updated since the courier picked it up.",
        "The delivery went to my old address instead of the new one.",
        "The courier says the box was left at the door, but nothing is there.",
        "I paid for express delivery and it still has not arrived.",
        "Half of the items came and the rest are nowhere to be seen.",
        "The driver never rang the bell and took the package back to the depot.",
        "Can the delivery be sent to a pickup point instead of my home?",
    ),
    "technical": (
        "The app crashes every time I open the settings screen.",
        "The device will not connect to my wifi after the latest update.",
        "The screen stays black although the power light is on.",
        "The software shows error 504 whenever I try to save a file.",
        "The battery drains from full to empty in about an hour.",
        "The firmware update stopped halfway and now nothing responds.",
        "Bluetooth pairing fails with my phone even after a reset.",
        "The sync between my laptop and the tablet stopped working yesterday.",
    ),
    "account": (
        "I cannot log in because the password reset email never comes.",
        "Someone changed the email address on my profile without asking me.",
        "I would like to delete my profile and all the data you hold on me.",
        "The two-factor code is sent to a phone number I no longer have.",
        "My username was locked after too many attempts to sign in.",
        "Please merge the two profiles I created with different emails.",
        "I want to change the name shown on my profile.",
        "My login works on the website but not in the mobile app.",
    ),
    "returns": (
        "The shoes are too small and I would like to send them back.",
        "The jacket arrived torn and I want to return it for a replacement.",
        "I sent the blender back two weeks ago and have had no refund yet.",
        "Where do I print the label to send this item back?",
        "The colour is not what the photo showed, so I want to return it.",
        "Can I exchange the lamp for the larger model?",
        "The return window says it closed, but I received the item only ten days ago.",
        "I returned the wrong item by mistake; can you send it back to me?",
    ),
}
GREETINGS = ("Hello,", "Hi there,", "Good morning,", "Dear support,", "Hey,", "Hi,")
ORDERS = (
    "It is about order {n}, the {product}.",
    "This concerns order {n} ({product}).",
    "Order number {n}, a {product}.",
    "My order is {n}: the {product}.",
)
PRODUCTS = (
    "wireless headphones",
    "coffee grinder",
    "desk lamp",
    "running shoes",
    "winter jacket",
    "smart watch",
    "blender",
    "e-reader",
    "backpack",
    "phone case",
)
CLOSINGS = ("Thanks.", "Thank you for your help.", "Please help.", "Regards, Sam", "Best, Alex", "")

_WORD = re.compile(r"[a-z]+")  # linear: one character class, no nesting
_PROBLEM_OF = {problem: team for team, problems in PROBLEMS.items() for problem in problems}


def generate_prompts(count: int = DEFAULT_COUNT, seed: int = DEFAULT_SEED) -> list[dict[str, Any]]:
    """``count`` distinct prompts ``{"messages": [...], "expected": team}``, the teams taking
    turns so each has a fifth; the same seed gives the same list."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    while len(out) < count:
        team = TEAMS[len(out) % len(TEAMS)]
        number, product = rng.randint(10_000, 99_999), rng.choice(PRODUCTS)
        order = rng.choice(ORDERS).format(n=number, product=product)
        parts = (rng.choice(GREETINGS), rng.choice(PROBLEMS[team]), order, rng.choice(CLOSINGS))
        message = " ".join(p for p in parts if p)
        if message in seen:
            continue
        seen.add(message)
        out.append({"messages": user_turn(INSTRUCTION, MARKER, message), "expected": team})
    return out


# Generated at load (seeded, so always the same set, in a fixed order).
load_prompts = prompt_loader(generate_prompts)


def expected_team(prompt_messages: list[dict[str, Any]]) -> str:
    """The team of the problem the prompt's message describes; ValueError for a prompt this
    task did not write."""
    message = task_data(prompt_messages, INSTRUCTION, MARKER, "triage_reward")
    found = {team for problem, team in _PROBLEM_OF.items() if problem in message}
    if len(found) != 1:
        raise ValueError(f"triage_reward: no problem of this task in {message[:80]!r}")
    return found.pop()


def triage_reward(prompt_messages: list[dict[str, Any]], sample: dict[str, Any]) -> float:
    """1 for a reply that is the right team's name alone (any case, quotes or a full stop
    around it), 0.6 for one that names the right team and no other among more words, 0 for
    anything else (a wrong team, several, none)."""
    want = expected_team(prompt_messages)
    content = sample.get("content")
    text = content if isinstance(content, str) else ""
    words = _WORD.findall(text[:4000].lower())
    named = {w for w in words if w in TEAMS}
    if named != {want}:
        return 0.0
    return ALONE if words == [want] else WITH_TEXT
