"""Write what is derived from the settings models: the chart's values schema and the reference.

``python -m ratchet.settings.generate`` writes ``helm/ratchet/values.schema.json``,
``helm/ratchet/templates/_settings-defaults.tpl`` (the few defaults the chart's templates read)
and ``docs/reference/settings.md``; ``--check`` writes nothing and exits 1 when any differs from
what it would write. The models are the one source of every setting's type, bounds, choices and
description. The chart's own keys (image, replicas, probes, ...) are kept by hand in
``helm/schema/chart-only.json``; in it, ``{"$settings": "proxy", "$chartSets": [...]}`` stands
for a section of ratchet.yaml less the keys the chart sets itself, ``"$settings": "aliases"`` for
one alias, ``"$enumOf": "kafka.compression"`` fills ``enum`` with a setting's choices (after any
the node already lists), and ``"$override"`` merges chart-specific keywords over a (dotted)
property.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, TypeAdapter

from ratchet.settings.alias import AliasConfig
from ratchet.settings.console import ConsoleSettings
from ratchet.settings.judge import JudgeSettings
from ratchet.settings.kafka import KafkaSettings
from ratchet.settings.learner import LearnerSettings
from ratchet.settings.proxy import ProxySettings
from ratchet.settings.root import RatchetSettings

REPO = Path(__file__).resolve().parents[2]
SCHEMA_PATH = Path("helm/ratchet/values.schema.json")
CHART_PART_PATH = Path("helm/schema/chart-only.json")
PAGE_PATH = Path("docs/reference/settings.md")
DEFAULTS_TEMPLATE_PATH = Path("helm/ratchet/templates/_settings-defaults.tpl")
# The settings whose defaults the chart's templates read (its consistency checks in _helpers.tpl)
# where the values leave them out: values.yaml does not repeat the defaults, nor does a template.
TEMPLATE_DEFAULTS = ("learner.lora.rank", "aliases.gate.min_pairs", "aliases.gate.max_pairs")

# What a "$settings" marker may name: a section of ratchet.yaml, or one alias.
SECTIONS: dict[str, type[BaseModel]] = {
    "aliases": AliasConfig,
    "console": ConsoleSettings,
    "judge": JudgeSettings,
    "kafka": KafkaSettings,
    "learner": LearnerSettings,
    "proxy": ProxySettings,
}
# Formats that say what a string is for, not what it may hold: validators need not know them.
_DROPPED_KEYWORDS = {"title", "default", "writeOnly"}
_DROPPED_FORMATS = {"password", "path"}


def model_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON schema for values files: references inlined, no titles or defaults (a
    setting the values leave out takes the service's own), ``X | None`` as ``type: [X, "null"]``."""
    raw = model.model_json_schema()
    schema: dict[str, Any] = _plain(raw, raw.get("$defs", {}))
    return schema


def _plain(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_plain(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        return _plain({**target, **{k: v for k, v in node.items() if k != "$ref"}}, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED_KEYWORDS or key == "$defs":
            continue
        if key == "format" and value in _DROPPED_FORMATS:
            continue
        if key == "description":
            out[key] = " ".join(value.split())
        elif key == "properties":
            out[key] = {name: _plain(sub, defs) for name, sub in value.items()}
        else:
            out[key] = _plain(value, defs)
    return _nullable(out)


def _nullable(node: dict[str, Any]) -> dict[str, Any]:
    """``anyOf: [{type: X, ...}, {type: null}]`` as ``{type: [X, null], ...}`` where X has no
    choices (the bounds then sit where a reader and the tests look for them)."""
    options = node.get("anyOf")
    if not options or len(options) != 2 or {"type": "null"} not in options:
        return node
    (other,) = [option for option in options if option != {"type": "null"}]
    if not isinstance(other.get("type"), str) or {"enum", "const", "anyOf"} & set(other):
        return node
    merged = {k: v for k, v in node.items() if k != "anyOf"}
    merged.update(other)
    merged["type"] = [other["type"], "null"]
    return merged


def _literal_choices(path: str) -> list[Any]:
    section, name = path.split(".")
    annotation = SECTIONS[section].model_fields[name].annotation
    for arg in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(arg) is typing.Literal:
            return list(typing.get_args(arg))
    raise ValueError(f"{path} is not a choice among literals")


def _expand(node: Any) -> Any:
    """The chart-only schema with each marker replaced by what the models say."""
    if isinstance(node, list):
        return [_expand(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _expand(value) for key, value in node.items()}
    if "$enumOf" in node:
        node["enum"] = node.get("enum", []) + _literal_choices(node.pop("$enumOf"))
    if "$settings" in node:
        generated = model_schema(SECTIONS[node.pop("$settings")])
        for name in node.pop("$chartSets", []):
            del generated["properties"][name]  # a KeyError: the marker names no such setting
        for dotted, keywords in node.pop("$override", {}).items():
            target = generated
            for name in dotted.split("."):
                target = target["properties"][name]
            target.update(keywords)
        generated.update(node)
        node = generated
    return node


def values_schema(chart_part: dict[str, Any]) -> str:
    return json.dumps(_expand(copy.deepcopy(chart_part)), indent=2, sort_keys=True) + "\n"


# ---- the defaults the templates read --------------------------------------------------------


def field_default(dotted: str) -> Any:
    """The model's own default of a setting (``section.name[.name...]``), read from the fields,
    never from this machine's environment."""
    section, *names = dotted.split(".")
    model: type[BaseModel] = SECTIONS[section]
    for name in names[:-1]:
        sub = model.model_fields[name].annotation
        assert isinstance(sub, type) and issubclass(sub, BaseModel), dotted
        model = sub
    field = model.model_fields[names[-1]]
    assert field.default_factory is None, f"{dotted} is computed at start"
    return TypeAdapter(Any).dump_python(field.default, mode="json")


def defaults_template() -> str:
    """A named template the chart's checks read with ``include ... | fromYaml``."""
    defaults: dict[str, Any] = {}
    for dotted in TEMPLATE_DEFAULTS:
        *parents, leaf = dotted.split(".")
        node = defaults
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = field_default(dotted)
    return (
        "{{/* Generated by `python -m ratchet.settings.generate` from the models in\n"
        "ratchet/settings/ (edit those, then run it): the defaults of the settings the templates\n"
        "read where the values leave them out. */}}\n"
        '{{- define "ratchet.settingsDefaults" -}}\n'
        + json.dumps(defaults, indent=2, sort_keys=True)
        + "\n{{- end }}\n"
    )


# ---- the reference page ----------------------------------------------------------------------

PAGE_HEAD = """# Settings reference

<!-- Generated by `python -m ratchet.settings.generate` from the models in ratchet/settings/:
edit those, then run it. A test fails when this page is stale. -->

Every service reads one `ratchet.yaml` (`$RATCHET_CONFIG`, else `./ratchet.yaml`, or
`--config PATH`). Environment variables override it: `RATCHET_` and the setting's path with `__`
between parts (lists and mappings as JSON), e.g. `RATCHET_PROXY__PORT=9000`. With
`RATCHET_SECRETS_DIR` set, a file of that folder named as a variable sets it too (a Kubernetes
Secret mounted as a volume). Values are checked when a service starts: a bad one stops it with a
message that names the setting and the fix. In the Helm chart, a section's settings go under
`<service>.config` and an alias's under `aliases.<name>`.
"""


def _type_text(schema: dict[str, Any]) -> str:
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        return "one of " + ", ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    if "anyOf" in schema:
        return " or ".join(_type_text(option) for option in schema["anyOf"])
    kind = schema.get("type", "any")
    kinds = kind if isinstance(kind, list) else [kind]
    words = []
    for k in kinds:
        if k == "array":
            words.append(f"list of {_type_text(schema.get('items', {}))}")
        elif k == "object" and isinstance(schema.get("additionalProperties"), dict):
            words.append(f"mapping to {_type_text(schema['additionalProperties'])}")
        else:
            words.append(str(k))
    return " or ".join(words)


def _bounds_text(schema: dict[str, Any]) -> str:
    signs = {"minimum": "≥", "exclusiveMinimum": ">", "maximum": "≤", "exclusiveMaximum": "<"}
    return ", ".join(f"{sign} {schema[key]}" for key, sign in signs.items() if key in schema)


def _default_text(model: type[BaseModel], name: str) -> str:
    """The field's own default, never what this machine's environment or ratchet.yaml say."""
    field = model.model_fields[name]
    if field.default_factory is not None:
        return "computed at start"
    if field.default is None:
        return "unset"
    default = TypeAdapter(Any).dump_python(field.default, mode="json")
    if isinstance(default, dict) and all(isinstance(v, dict) for v in default.values()):
        return ", ".join(f"`{key}` with the defaults below" for key in default)
    return f"`{json.dumps(default)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _section_rows(
    model: type[BaseModel], prefix: str, env: str, out: list[str], nested: list[Any]
) -> None:
    schema = model_schema(model)
    for name, prop in schema["properties"].items():
        annotation = model.model_fields[name].annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            nested.append((annotation, f"{prefix}{name}.", f"{env}{name.upper()}__"))
            continue
        row = [
            f"`{prefix}{name}`",
            _cell(_type_text(prop)),
            _cell(_default_text(model, name)),
            _cell(_bounds_text(prop)),
            f"`{env}{name.upper()}`",
            _cell(prop.get("description", "")),
        ]
        out.append("| " + " | ".join(row) + " |")


def _section(model: type[BaseModel], prefix: str, env: str, title: str) -> list[str]:
    lines = [f"## {title}", ""]
    doc = " ".join((model.__doc__ or "").split())
    if doc and model is not RatchetSettings:
        lines += [doc, ""]
    lines += [
        "| Setting | Type | Default | Bounds | Environment variable | What it does |",
        "|---|---|---|---|---|---|",
    ]
    nested: list[Any] = []
    _section_rows(model, prefix, env, lines, nested)
    lines.append("")
    for sub, sub_prefix, sub_env in nested:
        if sub_prefix.count(".") == 1 and prefix == "":
            continue  # a top-level section: its own heading follows
        lines += _section(sub, sub_prefix, sub_env, f"`{sub_prefix.rstrip('.')}`")
    return lines


def reference_page() -> str:
    lines = [*PAGE_HEAD.splitlines(), ""]
    lines += _section(RatchetSettings, "", "RATCHET_", "Top level")
    for name in ("kafka", "proxy", "judge", "learner", "console"):
        lines += _section(SECTIONS[name], f"{name}.", f"RATCHET_{name.upper()}__", f"`{name}`")
    lines += _section(
        AliasConfig, "aliases.<name>.", "RATCHET_ALIASES__<NAME>__", "`aliases.<name>`: each alias"
    )
    return "\n".join(lines).rstrip("\n") + "\n"


# ---- the command -----------------------------------------------------------------------------


def outputs(root: Path) -> dict[Path, str]:
    """Each generated file and the text it should hold."""
    chart_part = json.loads((root / CHART_PART_PATH).read_text())
    return {
        root / SCHEMA_PATH: values_schema(chart_part),
        root / DEFAULTS_TEMPLATE_PATH: defaults_template(),
        root / PAGE_PATH: reference_page(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ratchet.settings.generate", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when stale")
    parser.add_argument("--root", type=Path, default=REPO, help="the repository (default: this)")
    args = parser.parse_args(argv)
    stale = []
    for path, text in outputs(args.root).items():
        current = path.read_text() if path.is_file() else None
        if current == text:
            continue
        stale.append(path)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for path in stale:
        verb = "is stale" if args.check else "written"
        print(f"{path.relative_to(args.root)} {verb}", file=sys.stderr)
    if args.check and stale:
        print("run: python -m ratchet.settings.generate", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
