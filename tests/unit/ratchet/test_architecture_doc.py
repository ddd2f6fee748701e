"""docs/architecture.md stays true: every Redis key family and Kafka topic the code uses is listed
there, nothing listed there is gone from the code, and its ports are the settings' defaults.

Keys are read from the source, not from a list kept here: every string the code builds that
starts with ``ratchet:`` (a literal, an f-string, or ``+`` of literals and module constants),
with each part not known from the source (``{alias}``, a call, a ``*`` glob) as a hole. Such a
template must be a family the document lists (holes match its ``<placeholders>``), or, if it
ends in ``:`` (a prefix constant such as ``KEY_PREFIX``), the start of one. Topics are the
``*_TOPIC`` constants of ``ratchet/records.py``; any other ``ratchet.<word>`` literal that is not
a module of the kernel must be listed too, as a topic or as a file.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from ratchet.records import RECORD_TYPES
from ratchet.settings import RatchetSettings

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("ratchet", "proxy", "judge", "learner", "console", "cli", "embedded", "tasks")
HOLE = "<>"
KEY_START = "ratchet:"
TOPIC_LITERAL = re.compile(r"ratchet\.([a-z_]+)")
# Parts of a plain literal that stand for a value: str.format fields, %-formats, SCAN globs.
LITERAL_HOLES = re.compile(r"\{[^{}]*\}|%[sdr]|\*")
PLACEHOLDER = re.compile(r"<[^<>]*>")
BACKTICKED = re.compile(r"`([^`]+)`")


# ---- the code ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Found:
    text: str  # the template, holes as HOLE
    where: str  # path:line

    def __str__(self) -> str:
        return f"{self.text!r} ({self.where})"


def module_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "literal"`` assignments: what a key built from ``NAME`` starts with."""
    constants: dict[str, str] = {}
    for node in tree.body:
        value: ast.expr | None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        else:
            continue
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            for target in targets:
                if isinstance(target, ast.Name):
                    constants[target.id] = value.value
    return constants


class Templates:
    """Every string expression of one module, folded to a template (see the module docstring)."""

    def __init__(self, tree: ast.Module, where: str) -> None:
        self.constants = module_constants(tree)
        self.where = where
        self.found: list[Found] = []
        self._visit(tree)

    def _fold(self, node: ast.AST) -> str | None:
        """The string the expression builds, HOLE for each unknown part; None: not a string."""
        if isinstance(node, ast.Constant):
            return LITERAL_HOLES.sub(HOLE, node.value) if isinstance(node.value, str) else None
        if isinstance(node, ast.Name):
            return self.constants.get(node.id)
        if isinstance(node, ast.JoinedStr):
            parts = [
                str(part.value)
                if isinstance(part, ast.Constant)
                else self._fold(part.value)
                if isinstance(part, ast.FormattedValue)
                else None
                for part in node.values
            ]
            return "".join(HOLE if p is None else p for p in parts)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = self._fold(node.left), self._fold(node.right)
            if left is None and right is None:
                return None
            return (HOLE if left is None else left) + (HOLE if right is None else right)
        return None

    def _inner(self, node: ast.AST) -> Iterator[ast.AST]:
        """The sub-expressions of a folded string that are not part of it (calls, attributes)."""
        if isinstance(node, ast.JoinedStr):
            for part in node.values:
                if isinstance(part, ast.FormattedValue):
                    yield part.value
        elif isinstance(node, ast.BinOp):
            for side in (node.left, node.right):
                if isinstance(side, ast.BinOp | ast.JoinedStr):
                    yield from self._inner(side)
                elif not isinstance(side, ast.Constant | ast.Name):
                    yield side

    def _visit(self, node: ast.AST) -> None:
        if _is_docstring(node):
            return
        if isinstance(node, ast.Constant | ast.JoinedStr | ast.BinOp):
            text = self._fold(node)
            if text is not None:
                if text.startswith(KEY_START) or TOPIC_LITERAL.fullmatch(text):
                    self.found.append(Found(text, f"{self.where}:{getattr(node, 'lineno', 0)}"))
                for inner in self._inner(node):
                    self._visit(inner)
                return
        for child in ast.iter_child_nodes(node):
            self._visit(child)


def _is_docstring(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def templates_of(source: str, where: str = "<source>") -> list[Found]:
    return Templates(ast.parse(source), where).found


def code_templates() -> list[Found]:
    found: list[Found] = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            found += templates_of(path.read_text(encoding="utf-8"), where)
    return found


def topic_constants() -> dict[str, str]:
    """``*_TOPIC`` constants of ratchet/records.py: name -> topic."""
    tree = ast.parse((ROOT / "ratchet" / "records.py").read_text(encoding="utf-8"))
    return {k: v for k, v in module_constants(tree).items() if k.endswith("_TOPIC")}


def is_kernel_module(literal: str) -> bool:
    """``ratchet.<word>`` names a module or package of the kernel (an import path, not a topic)."""
    word = literal.split(".", 1)[1]
    return (ROOT / "ratchet" / f"{word}.py").is_file() or (ROOT / "ratchet" / word).is_dir()


# ---- the document ------------------------------------------------------------------------------


def section(doc: str, heading: str) -> str:
    """The text under the ``## <heading>`` line, up to the next ``## `` heading."""
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(f"## {heading}")), None)
    assert start is not None, f"docs/architecture.md has no '## {heading}' section"
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), None)
    return "\n".join(lines[start + 1 : end])


def table_rows(text: str) -> list[list[str]]:
    """The cells of every table row in ``text`` (header and ruler rows left out)."""
    lines = text.splitlines()
    rows = []
    for line, after in zip(lines, [*lines[1:], ""], strict=True):
        if not line.startswith("|") or is_ruler(line) or is_ruler(after):
            continue  # not a row, a ruler, or a header (the row above a ruler)
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def is_ruler(line: str) -> bool:
    return line.startswith("|") and set(line.strip()) <= set("|-: ")


def doc_key_families(doc: str) -> dict[str, str]:
    """Normalized family -> as written, from the first cell of each row under Redis keys."""
    families = {}
    for cells in table_rows(section(doc, "Redis keys")):
        for key in BACKTICKED.findall(cells[0]):
            if key.startswith(KEY_START):
                families[PLACEHOLDER.sub(HOLE, key)] = key
    return families


def doc_topics(doc: str) -> dict[str, str]:
    """Topic -> the record class its row names."""
    topics = {}
    for cells in table_rows(section(doc, "Kafka topics")):
        (topic,) = BACKTICKED.findall(cells[0])
        (record,) = BACKTICKED.findall(cells[2])
        topics[topic] = record
    return topics


def doc_files(doc: str) -> set[str]:
    return {BACKTICKED.findall(c[0])[0] for c in table_rows(section(doc, "Files named"))}


def uncovered_keys(found: list[Found], families: set[str]) -> list[Found]:
    """Key templates no listed family accounts for."""
    return [
        f
        for f in found
        if f.text.startswith(KEY_START)
        and f.text not in families
        and not (f.text.endswith(":") and any(d.startswith(f.text) for d in families))
    ]


def unlisted_topic_literals(found: list[Found], listed: set[str]) -> list[Found]:
    """``ratchet.<word>`` literals that are neither a kernel module nor listed in the document."""
    return [
        f
        for f in found
        if TOPIC_LITERAL.fullmatch(f.text) and not is_kernel_module(f.text) and f.text not in listed
    ]


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def found() -> list[Found]:
    return code_templates()


# ---- the checks ----------------------------------------------------------------------------------


def test_every_redis_key_family_in_the_code_is_listed(doc: str, found: list[Found]) -> None:
    missing = uncovered_keys(found, set(doc_key_families(doc)))
    assert not missing, "Redis keys missing from docs/architecture.md:\n" + "\n".join(
        map(str, missing)
    )


def test_every_listed_redis_key_family_is_used(doc: str, found: list[Found]) -> None:
    used = {f.text for f in found}
    stale = [written for family, written in doc_key_families(doc).items() if family not in used]
    assert not stale, f"docs/architecture.md lists key families the code no longer uses: {stale}"


def test_the_key_families_are_found_at_all(doc: str, found: list[Found]) -> None:
    # A walk that finds nothing would pass the checks above: about 30 families exist today.
    keys = {f.text for f in found if f.text.startswith(KEY_START)}
    assert len(keys) >= 30
    assert len(doc_key_families(doc)) >= 30


def test_every_topic_is_listed_with_its_record(doc: str, found: list[Found]) -> None:
    topics = doc_topics(doc)
    constants = topic_constants()
    assert set(constants.values()) == set(RECORD_TYPES), "a *_TOPIC without a record, or reverse"
    assert set(topics) == set(constants.values()), (
        f"topic table {sorted(topics)} != ratchet/records.py {sorted(constants.values())}"
    )
    for topic, record in topics.items():
        assert record == RECORD_TYPES[topic].__name__, f"{topic}: the record is {record}"


def test_every_other_ratchet_dot_name_is_a_module_or_listed(doc: str, found: list[Found]) -> None:
    listed = set(doc_topics(doc)) | doc_files(doc)
    missing = unlisted_topic_literals(found, listed)
    assert not missing, "topic-like names missing from docs/architecture.md:\n" + "\n".join(
        map(str, missing)
    )
    used = {f.text for f in found}
    assert doc_files(doc) <= used, "docs/architecture.md lists a ratchet.* file no code names"


def setting_default(path: str) -> Any:
    """The default of a dotted setting (``proxy.port``), without reading env or ratchet.yaml."""
    first, *rest = path.split(".")
    value = RatchetSettings.model_fields[first].get_default(call_default_factory=True)
    for name in rest:
        value = getattr(value, name)
    return value


def test_ports_are_the_settings_defaults(doc: str) -> None:
    rows = table_rows(section(doc, "Ports"))
    named: set[str] = set()
    for cells in rows:
        (address,) = BACKTICKED.findall(cells[1])
        host, port = address.rsplit(":", 1)
        settings = BACKTICKED.findall(cells[2])
        named |= set(settings)
        for setting in settings:
            default = setting_default(setting)
            if isinstance(default, int):
                assert default == int(port), f"{setting} defaults to {default}, not {port}"
            else:
                assert default == host or address in str(default), f"{setting}: {default!r}"
        env = BACKTICKED.findall(cells[3])[0]
        assert env == "RATCHET_" + settings[0].upper().replace(".", "__")
    # Every port setting has a row.
    for name, field in RatchetSettings.model_fields.items():
        section_default = field.get_default(call_default_factory=True)
        if isinstance(section_default, BaseModel):
            for sub in type(section_default).model_fields:
                if sub.endswith("port"):
                    assert f"{name}.{sub}" in named, f"{name}.{sub} has no row under Ports"


# ---- the matcher itself: what it must catch --------------------------------------------------


FAMILIES = {"ratchet:learner:<>:lease", "ratchet:completion:<>", "ratchet:completion:<>:rated"}


@pytest.mark.parametrize(
    "source",
    [
        'KEY = "ratchet:foo:bar:" + x',  # a new prefix
        'def k(a):\n    return f"ratchet:learner:{a}:newthing"',  # new family, known namespace
        'PREFIX = "ratchet:completion:"\ndef k(i):\n    return PREFIX + i + ":other"',
        'KEY = "ratchet:learner:{}:lease2".format(a)',
        'scan(match="ratchet:judge:*")',
    ],
)
def test_a_new_key_family_is_caught(source: str) -> None:
    assert uncovered_keys(templates_of(source), FAMILIES)


@pytest.mark.parametrize(
    "source",
    [
        'def k(a):\n    return f"ratchet:learner:{a}:lease"',
        'PREFIX = "ratchet:completion:"\ndef k(i):\n    return PREFIX + i + ":rated"',
        'PREFIX = "ratchet:completion:"\ndef k(i):\n    return f"{PREFIX}{i}"',
        '"""ratchet:not:a:key in a docstring"""',
    ],
)
def test_a_listed_key_family_passes(source: str) -> None:
    assert not uncovered_keys(templates_of(source), FAMILIES)


def test_a_new_topic_literal_is_caught_and_a_module_path_is_not() -> None:
    found = templates_of('T = "ratchet.foo"\nresources.files("ratchet.rewards")')
    assert [f.text for f in unlisted_topic_literals(found, {"ratchet.traffic"})] == ["ratchet.foo"]
