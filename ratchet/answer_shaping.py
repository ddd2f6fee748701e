"""Which request parameters let a client write the answer it gets, read as vLLM reads them.

On an alias that learns from its answers, a client that writes (part of) its own answer writes
the evidence it is judged or rated on: its groups train on its text, its ratings score it (audit
H-4, N-4). The proxy refuses such requests (proxy/validation.py); the judge never replays a
constraint that fixes the answer when it samples a group (judge/sampler.py). Both ask here.

**Flags.** vLLM's request models (``ChatCompletionRequest``, ``CompletionRequest``) declare
``echo``, ``continue_final_message`` and ``add_generation_prompt`` as pydantic ``bool`` fields
in lax mode, so ``1``, ``"true"``, ``"yes"``, ``"on"``, ``0`` and ``"off"`` are all booleans to
them. :func:`vllm_bool` reads a value with pydantic's own bool validator, so a spelling is
refused exactly when vLLM would act on it (tests/unit/ratchet/test_answer_shaping.py checks the
two agree, spelling by spelling, against the installed vLLM's models).

**Constraints that fix the answer.** A JSON schema, a regex or a choice list that admits only a
few answers makes the client their author, whatever the model would have said. Counted here:
:func:`schema_answers` and :func:`regex_answers` give how many answers a constraint admits (None:
too many to count). A constraint is *fixing* when it admits at most :data:`MAX_FIXED_ANSWERS`, or
when it enumerates the whole answer (``enum``/``const`` at the top, ``choice``). A grammar or a
structural tag is a language of its own that is not analysed: on a learning alias it is refused.

**Kin.** ``chat_template`` (a client template can end on its own assistant text), a short
``allowed_token_ids``, a positive ``logit_bias`` and one that bans more than
:data:`MAX_BANNED_TOKENS` tokens (each steers the answer to tokens the client chose) write the
answer too, as does a ``tool_choice`` that forces a call of tools whose parameters schemas are
fixing (vLLM decodes the arguments under that schema). vLLM 0.32 ignores the removed
``guided_*`` fields, so they are not checked.
"""

from __future__ import annotations

import importlib
import math
import re
from typing import Any

import orjson
from pydantic import TypeAdapter, ValidationError

# The parser behind re (Python 3.11+), which reads the regex dialect JSON schemas use; it has no
# type stubs.
_sre: Any = importlib.import_module("re._parser")

# The value of each flag with which the request writes part of its answer: echo puts the
# prompt's (chat: the last assistant message's) text in the answer, continue_final_message has
# the answer go on from the client's own assistant text, and add_generation_prompt false lets the
# answer continue the client's turn.
SHAPING_FLAGS: dict[str, bool] = {
    "echo": True,
    "continue_final_message": True,
    "add_generation_prompt": False,
}
# A constraint admitting this few answers (or fewer) fixes the answer: the client wrote each.
MAX_FIXED_ANSWERS = 16
# allowed_token_ids this short spells the answer out of the client's tokens.
MAX_FIXED_TOKENS = 16
# Negative logit_bias entries past this many: banning nearly the whole vocabulary leaves the
# answer to the few tokens left, as surely as a positive bias would. Any negative value counts
# (a uniform -5 on all but a few tokens steers as -100 does). A vocabulary has 32k-150k tokens,
# so honest bans (a few words, a language's script) fit and the model keeps its choice.
MAX_BANNED_TOKENS = 1024
# Levels of a schema (nesting and $ref hops together) read before counting stops: a cycle, or
# a schema built to be slow.
MAX_DEPTH = 64
# Nodes of a schema or a regex looked at before counting stops: past it, "too many to count".
MAX_NODES = 2048

_BOOL: TypeAdapter[bool] = TypeAdapter(bool)


def vllm_bool(value: Any) -> bool | None:
    """``value`` as vLLM's pydantic ``bool`` field reads it (lax mode: ``1``, ``"yes"``,
    ``"off"``...); None for a value it refuses (vLLM answers 400) or for ``null``."""
    if value is None:
        return None
    try:
        return _BOOL.validate_python(value)
    except ValidationError:
        return None


# vLLM's /v1/completions reads only echo of the flags (and has no chat template): the others
# are extra fields there, which it ignores.
COMPLETION_FLAGS = ("echo",)


def shaping_flag(payload: dict[str, Any], chat: bool = True) -> str | None:
    """The first flag of :data:`SHAPING_FLAGS` that vLLM would read as its shaping value, on
    /v1/chat/completions (``chat``) or /v1/completions."""
    for param, shaping in SHAPING_FLAGS.items():
        read = (chat or param in COMPLETION_FLAGS) and param in payload
        if read and vllm_bool(payload[param]) is shaping:
            return param
    return None


# Every parameter :func:`answer_shaping` reads (``tools`` only with ``tool_choice``): a body with
# none of them is let through before any check.
READ_PARAMS = frozenset(
    [
        *SHAPING_FLAGS,
        "chat_template",
        "allowed_token_ids",
        "logit_bias",
        "response_format",
        "structured_outputs",
        "tool_choice",
    ]
)


def answer_shaping(payload: dict[str, Any], chat: bool = True) -> tuple[str, str] | None:
    """(parameter, why) for the first parameter of a request body with which the client writes
    part of its answer; None when it has none. Each reading is vLLM's; ``chat``: the body is
    for /v1/chat/completions, else /v1/completions."""
    if READ_PARAMS.isdisjoint(payload):  # most requests: none of them, on every request
        return None
    flag = shaping_flag(payload, chat)
    if flag is not None:
        value = str(SHAPING_FLAGS[flag]).lower()
        return flag, f"{flag} (read as {value}) would have the answer repeat or continue its text"
    if chat and payload.get("chat_template"):  # vLLM takes "" as no template of the client's
        return "chat_template", "a client's chat template can end on text of its own"
    checks = (_token_steering, _fixing_response_format, _fixing_structured_outputs, _forced_call)
    for check in checks:
        found = check(payload)
        if found is not None:
            return found
    return None


def _token_steering(payload: dict[str, Any]) -> tuple[str, str] | None:
    allowed = payload.get("allowed_token_ids")
    if isinstance(allowed, list) and 0 < len(allowed) <= MAX_FIXED_TOKENS:
        return (
            "allowed_token_ids",
            f"{len(allowed)} allowed tokens would spell the answer out of the client's tokens",
        )
    bias = payload.get("logit_bias")
    if not isinstance(bias, dict):
        return None
    readings = [_bias(value) for value in bias.values()]
    if any(reading > 0 for reading in readings):
        return "logit_bias", "a positive bias would push tokens the client chose into the answer"
    banned = sum(reading < 0 for reading in readings)
    if banned > MAX_BANNED_TOKENS:
        return (
            "logit_bias",
            f"{banned} negative biases (more than {MAX_BANNED_TOKENS}) would leave the answer "
            "only the tokens the client did not ban",
        )
    return None


def _bias(value: Any) -> float:
    """vLLM's ``float`` reading of a bias (it clamps to [-100, 100]); 0 for one it refuses."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return 0.0
    return number if math.isfinite(number) else 0.0


def _fixing_response_format(payload: dict[str, Any]) -> tuple[str, str] | None:
    response_format = payload.get("response_format")
    if fixing_response_format(response_format):
        return "response_format", "its schema or structural tag can fix the answer"
    return None


def fixing_response_format(response_format: Any) -> bool:
    """Whether a ``response_format`` fixes the answer: its ``json_schema`` is fixing, or it is a
    ``structural_tag`` (a language of its own, as in ``structured_outputs``)."""
    if not isinstance(response_format, dict):
        return False
    if response_format.get("type") == "structural_tag":
        return True
    if response_format.get("type") != "json_schema":
        return False
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    return schema_fixing(schema)


def _fixing_structured_outputs(payload: dict[str, Any]) -> tuple[str, str] | None:
    outputs = payload.get("structured_outputs")
    if not isinstance(outputs, dict):
        return None
    param = "structured_outputs"
    if outputs.get("choice") is not None:
        return param, "choice lists every answer the model may give"
    for free_form in ("grammar", "structural_tag"):
        if outputs.get(free_form) is not None:
            return param, f"a {free_form} can fix the answer and is not accepted on this model"
    regex = outputs.get("regex")
    if isinstance(regex, str) and regex_fixing(regex):
        return param, f"its regex admits at most {MAX_FIXED_ANSWERS} answers"
    schema = outputs.get("json")
    if isinstance(schema, str):
        try:
            schema = orjson.loads(schema)
        except orjson.JSONDecodeError:
            return None  # vLLM refuses it
    if schema_fixing(schema):
        return param, "its json schema admits only answers the request wrote"
    return None


def _forced_call(payload: dict[str, Any]) -> tuple[str, str] | None:
    """A ``tool_choice`` that forces a call (named, or ``required``) of tools whose
    ``parameters`` schemas are each fixing: vLLM decodes the call's arguments under that schema,
    so the client wrote the call the answer is."""
    choice = payload.get("tool_choice")
    tools = [t for t in payload.get("tools") or () if isinstance(t, dict)]
    functions: list[dict[str, Any]] = [
        t["function"] for t in tools if isinstance(t.get("function"), dict)
    ]
    if choice == "required":
        forced = functions
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        forced = [f for f in functions if f.get("name") == name]
    else:
        return None
    if forced and all(schema_fixing(f.get("parameters")) for f in forced):
        return "tool_choice", "it forces a call whose arguments' schema admits only what it wrote"
    return None


# ---- counting what a constraint admits ---------------------------------------------------------


def schema_fixing(schema: Any) -> bool:
    """Whether a JSON schema fixes the answer: ``enum``/``const`` on the whole answer, or at most
    :data:`MAX_FIXED_ANSWERS` answers in all."""
    if not isinstance(schema, dict):
        return False
    if "const" in schema or "enum" in schema:
        return True
    answers = schema_answers(schema)
    return answers is not None and answers <= MAX_FIXED_ANSWERS


def regex_fixing(pattern: str) -> bool:
    answers = regex_answers(pattern)
    return answers is not None and answers <= MAX_FIXED_ANSWERS


class _Budget:
    """Nodes left to look at; counting gives up (too many to count) when they run out."""

    def __init__(self) -> None:
        self.left = MAX_NODES

    def spend(self) -> bool:
        self.left -= 1
        return self.left >= 0


def schema_answers(schema: Any) -> int | None:
    """How many JSON values ``schema`` admits; None when unbounded or too many to count.

    Only what bounds a value is read: ``const``, ``enum``, a string's ``pattern``, ``boolean``
    and ``null``, a bounded ``integer``, objects that allow no other properties, and the
    combinators (``anyOf``/``oneOf`` add up, ``allOf`` is at most its smallest part); local
    ``$ref``s are followed, to :data:`MAX_DEPTH` levels. Everything else counts as unbounded,
    which only ever lets a request through, never refuses it."""
    return _count(schema, schema, _Budget(), 0)


def _count(node: Any, root: Any, budget: _Budget, depth: int) -> int | None:
    if not isinstance(node, dict) or not budget.spend() or depth > MAX_DEPTH:
        return None
    depth += 1
    if isinstance(node.get("$ref"), str):
        return _count(_resolve(root, node["$ref"]), root, budget, depth)
    if "const" in node:
        return 1
    if isinstance(node.get("enum"), list):
        return len(node["enum"])
    for combinator in ("anyOf", "oneOf"):
        if isinstance(node.get(combinator), list):
            parts = [_count(part, root, budget, depth) for part in node[combinator]]
            return None if None in parts else _capped(sum(p or 0 for p in parts))
    if isinstance(node.get("allOf"), list):
        parts = [_count(part, root, budget, depth) for part in node["allOf"]]
        known = [p for p in parts if p is not None]
        return min(known) if known else None
    return _count_typed(node, root, budget, depth)


def _count_typed(node: dict[str, Any], root: Any, budget: _Budget, depth: int) -> int | None:
    kind = node.get("type")
    if kind == "null":
        return 1
    if kind == "boolean":
        return 2
    if kind == "string" and isinstance(node.get("pattern"), str):
        return regex_answers(node["pattern"])
    if kind == "integer":
        low, high = node.get("minimum"), node.get("maximum")
        if isinstance(low, int | float) and isinstance(high, int | float):
            if not (_is_number(low) and _is_number(high)):
                return None
            return _capped(max(0, math.floor(high) - math.ceil(low) + 1))
        return None
    if kind == "object" and node.get("additionalProperties") is False:
        properties = node.get("properties")
        if not isinstance(properties, dict):
            return 1  # {} only
        required = set(node.get("required") or ())
        total = 1
        for name, part in properties.items():
            count = _count(part, root, budget, depth)
            if count is None:
                return None
            total = _capped(total * (count + (0 if name in required else 1)))
        return total
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _resolve(root: Any, ref: str) -> Any:
    """A local ``#/a/b`` reference inside ``root``; None for anything else."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        key = part.replace("~1", "/").replace("~0", "~")
        node = node.get(key) if isinstance(node, dict) else None
    return node


# Past this many answers nothing is learned from the exact number: it is not fixing.
_COUNT_CAP = 1 << 20


def _capped(count: int) -> int:
    return min(count, _COUNT_CAP)


def regex_answers(pattern: str) -> int | None:
    """How many strings a regex admits as a whole answer; None when unbounded, too many to
    count, or not a regex Python's parser reads (vLLM's backend then decides). Case flags are
    ignored: a pattern that spells its text in any case still spells it."""
    try:
        return _regex_count(list(_sre.parse(pattern)), _Budget())
    except (re.error, RecursionError, OverflowError):
        return None


_LITERALS = {_sre.LITERAL, _sre.AT}


def _regex_count(items: list[Any], budget: _Budget) -> int | None:
    total = 1
    for op, arg in items:
        if not budget.spend():
            return None
        count = _regex_item(op, arg, budget)
        if count is None:
            return None
        total = _capped(total * count)
    return total


def _regex_item(op: Any, arg: Any, budget: _Budget) -> int | None:
    if op in _LITERALS:
        return 1
    if op is _sre.IN:
        return _class_size(arg)
    if op is _sre.SUBPATTERN:
        return _regex_count(list(arg[-1]), budget)
    if op is _sre.BRANCH:
        parts = [_regex_count(list(branch), budget) for branch in arg[1]]
        return None if None in parts else _capped(sum(p or 0 for p in parts))
    if op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT, getattr(_sre, "POSSESSIVE_REPEAT", None)):
        low, high, inner = arg
        if high == _sre.MAXREPEAT or high - low > 64:
            return None
        each = _regex_count(list(inner), budget)
        if each is None:
            return None
        return _capped(sum(_capped(each**times) for times in range(low, high + 1)))
    return None  # ANY, categories, negations, lookarounds: not counted


def _class_size(items: list[Any]) -> int | None:
    size = 0
    for op, arg in items:
        if op is _sre.LITERAL:
            size += 1
        elif op is _sre.RANGE:
            size += arg[1] - arg[0] + 1
        else:  # a negated class or a category (\d, \w): not counted
            return None
    return size
