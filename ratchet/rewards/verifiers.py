"""Programmatic rewards: load an operator's verifier function and run it safely.

A verifier is plain Python named in ``ratchet.yaml`` as ``"package.module:function"``; it takes
the prompt messages and one sample (an assistant message: ``content``, and ``tool_calls`` when
the model called a tool, which :func:`tool_calls_of` parses) and returns a float in [0, 1]. It is
the operator's code, so a wrong value is treated as a bug to report, never silently repaired:
an out-of-range or non-numeric result raises :class:`VerifierError` instead of being clamped.
"""

from __future__ import annotations

import copy
import importlib
import json
import math
from collections.abc import Callable
from numbers import Real
from typing import Any, cast

__all__ = [
    "VERIFIER_CAUSES",
    "Verifier",
    "VerifierError",
    "combine",
    "load_verifier",
    "run_verifier",
    "tool_calls_of",
]

Verifier = Callable[[list[dict[str, Any]], dict[str, Any]], float]

VERIFIER_CAUSES = ("import", "exception", "out_of_range", "non_numeric")


class VerifierError(Exception):
    """A verifier that could not be loaded or gave no usable reward.

    ``cause`` is one of :data:`VERIFIER_CAUSES`, a fixed word the service can count in a metric.
    """

    def __init__(self, cause: str, message: str) -> None:
        if cause not in VERIFIER_CAUSES:
            raise ValueError(f"unknown VerifierError cause {cause!r}")
        super().__init__(f"{cause}: {message}")
        self.cause = cause


def load_verifier(spec: str) -> Verifier:
    """Import the callable that ``"package.module:function"`` names; fail naming the spec.

    The part after the colon may be dotted (``"pkg.mod:Class.method"``). Call this at start-up,
    so a typo in the config stops the service at once rather than on the first group.
    """
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise VerifierError("import", f'verifier {spec!r} must look like "package.module:function"')
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:
        # Not only ImportError: a module that fails while importing is just as unusable.
        raise VerifierError(
            "import", f"verifier {spec!r}: cannot import module {module_name!r}: {exc!r}"
        ) from exc
    for name in attr_path.split("."):
        if not hasattr(target, name):
            raise VerifierError(
                "import", f"verifier {spec!r}: {module_name!r} has no attribute {attr_path!r}"
            )
        target = getattr(target, name)
    if not callable(target):
        raise VerifierError(
            "import", f"verifier {spec!r}: {attr_path!r} is a {type(target).__name__}, not callable"
        )
    return cast(Verifier, target)


def run_verifier(
    verifier: Verifier, prompt_messages: list[dict[str, Any]], sample: dict[str, Any]
) -> float:
    """Call ``verifier`` on one sample and return its reward, or raise VerifierError.

    The verifier gets copies, so a verifier that edits its arguments cannot change the group
    that is later written to Kafka.
    """
    name = getattr(verifier, "__qualname__", repr(verifier))
    try:
        value = verifier(copy.deepcopy(prompt_messages), copy.deepcopy(sample))
    except Exception as exc:
        raise VerifierError("exception", f"verifier {name} raised {exc!r}") from exc
    return _checked(name, value)


# Arguments longer than this are not parsed: a verifier's input is the model's output.
MAX_ARGUMENTS_CHARS = 64 * 1024


def tool_calls_of(sample: dict[str, Any]) -> list[tuple[str, dict[str, Any] | None]]:
    """The sample's function calls as (name, arguments): the arguments' JSON parsed to an
    object, or None when it is not one (the model wrote broken JSON, or something too long)."""
    calls: list[tuple[str, dict[str, Any] | None]] = []
    for call in sample.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        raw = function.get("arguments")
        arguments: Any = raw if isinstance(raw, dict) else None
        if isinstance(raw, str) and len(raw) <= MAX_ARGUMENTS_CHARS:
            try:
                arguments = json.loads(raw)
            except ValueError:
                arguments = None
        calls.append((function["name"], arguments if isinstance(arguments, dict) else None))
    return calls


def _checked(name: str, value: Any) -> float:
    """The value as a float if it is a real number in [0, 1]; bool and NaN are not numbers here."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise VerifierError("non_numeric", f"verifier {name} returned {value!r}, not a number")
    number = float(value)
    if math.isnan(number):
        raise VerifierError("non_numeric", f"verifier {name} returned NaN")
    if not 0.0 <= number <= 1.0:
        raise VerifierError("out_of_range", f"verifier {name} returned {number}, outside [0, 1]")
    return number


def combine(
    ruler: list[float] | None, verified: list[float] | None, ruler_weight: float
) -> list[float]:
    """The group's rewards from RULER scores, verifier scores, or a weighted mix of both.

    ``kind: ruler`` passes ``verified=None`` and ``kind: verifier`` passes ``ruler=None``: the
    other side comes back unchanged. ``kind: mixed`` passes both and gets, element by element,
    ``ruler_weight * ruler + (1 - ruler_weight) * verified``.
    """
    if ruler is None:
        if verified is None:
            raise ValueError("combine needs RULER scores, verifier scores, or both")
        return list(verified)
    if verified is None:
        return list(ruler)
    if len(ruler) != len(verified):
        raise ValueError(f"{len(ruler)} RULER scores but {len(verified)} verifier scores")
    if not 0.0 <= ruler_weight <= 1.0:
        raise ValueError(f"ruler_weight is {ruler_weight}, outside [0, 1]")
    return [
        ruler_weight * r + (1.0 - ruler_weight) * v for r, v in zip(ruler, verified, strict=True)
    ]
