"""The rendered ratchet.yaml is one the services accept, with secrets arriving the way the pods
get them, and the chart's schema refuses bad values with a message that names the value."""

from __future__ import annotations

import base64
import json
import re
import typing
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from pydantic import BaseModel
from redis.connection import parse_url

from ratchet import settings as ratchet_settings
from ratchet.secrets import redis_connection_url
from ratchet.settings import RatchetSettings, load_settings
from tests.deploy.conftest import CHART, FULLNAME, VALUES_FILES, Rendered, load_values, render

# Secrets the operator manages in the existing-secrets case, as Kubernetes would serve them.
EXISTING_SECRETS = {
    "ratchet-proxy-keys": {"keys.json": '["sk-SENTINEL-op-1"]', "admin": "sk-SENTINEL-op-admin"},
    "ratchet-kafka-user": {"password": "SENTINEL-op-kafka"},
    "ratchet-judge-kafka": {"password": "SENTINEL-op-judge-kafka"},
    "ratchet-learner-kafka": {"pw": "SENTINEL-op-learner-kafka"},
    "redis-auth": {"redis-password": "SENTINEL-op-redis"},
    "ratchet-judge-providers": {"RATCHET_JUDGE__JUDGE_API_KEY": "sk-SENTINEL-op-judge"},
    "hf-token": {"token": "hf_SENTINEL-vllm"},
    "hf-learner-token": {"HF_TOKEN": "hf_SENTINEL-learner"},
    "ratchet-server": {"secret": "SENTINEL-op-server-secret", "vllm-key": "SENTINEL-op-vllm-key"},
}
# Settings of a service's section that the chart sets itself, or that come from a Secret.
CHART_OWNED = {
    "proxy": {"host", "port", "api_keys", "admin_key", "user_vouching_keys"},
    "judge": {"metrics_host", "metrics_port", "judge_api_key"},
    "learner": {"metrics_host", "metrics_port", "base_model_path"},
    "console": {"host", "port", "proxy_url", "proxy_metrics_url", "judge_metrics_url"},
}
# The chart's Kafka values and the `kafka` settings they set.
KAFKA_VALUES = {
    "securityProtocol": "security_protocol",
    "topics.partitions": "topic_partitions",
    "topics.replication": "topic_replication",
    "topics.retentionMs": "topic_retention_ms",
    "compression": "compression",
    "idempotence": "idempotence",
    "sessionTimeoutMs": "session_timeout_ms",
}
CHART_DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
SECTIONS = {
    "proxy": ratchet_settings.ProxySettings,
    "judge": ratchet_settings.JudgeSettings,
    "learner": ratchet_settings.LearnerSettings,
}
# The only settings values.yaml sets under a `<service>.config` block or as a Kafka value, and
# why: the chart's decisions. Every other setting is left out there, so the service's own default
# applies (one copy of each default: the models in ratchet/settings/).
CHART_DECISIONS = {
    # SASL over TLS unless allowInsecure: whoever can produce to ratchet.groups chooses what the
    # learner trains on. The services' default (PLAINTEXT) suits the local dev stack.
    ("kafka", "securityProtocol"),
    # Three copies of each topic; the services' default (1) suits a one-broker dev cluster.
    ("kafka", "topics.replication"),
    # The bare service redacts nothing; a release redacts e-mail addresses before Kafka.
    ("proxy", "redact_patterns"),
    # The chart gives the learner GPUs of its own: sampling goes on while a round trains,
    # whatever the service's default becomes.
    ("judge", "pause_while_training"),
}


def container_env(r: Rendered, deployment: str) -> dict[str, str]:
    """The environment Kubernetes gives the container: Secret references resolved, $(VAR)
    references expanded against the variables before them, as the kubelet does."""
    secrets = _secret_values(r)
    env: dict[str, str] = {}
    container = r.container(deployment)
    # envFrom first: an `env` entry of the same name wins, as in Kubernetes.
    for source in container.get("envFrom", []):
        name = source["secretRef"]["name"]
        assert name in secrets, f"{deployment}: envFrom names Secret {name}, which is not there"
        env.update(secrets[name])
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = re.sub(
                r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), var["value"]
            )
            continue
        ref = var["valueFrom"]["secretKeyRef"]
        value = secrets.get(ref["name"], {}).get(ref["key"])
        if value is None:
            assert ref.get("optional"), f"{var['name']}: no key {ref['key']} in {ref['name']}"
            continue
        env[var["name"]] = value
    return env


def secret_file_refs(r: Rendered, deployment: str) -> dict[str, dict[str, Any]]:
    """Each file of the folder RATCHET_SECRETS_DIR names, as the Secret key it projects:
    {"RATCHET_SECRET": {"name": <Secret>, "key": <key>, "optional": bool}, ...}."""
    container = r.container(deployment)
    folder = next(v["value"] for v in container["env"] if v["name"] == "RATCHET_SECRETS_DIR")
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == folder)
    assert mount.get("readOnly"), f"{deployment}: the secrets volume is writable"
    pod = r.get("Deployment", deployment)["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    refs: dict[str, dict[str, Any]] = {}
    for source in volume["projected"]["sources"]:
        secret = source["secret"]
        for item in secret["items"]:
            assert item["path"] not in refs, f"{deployment}: two secrets write {item['path']}"
            refs[item["path"]] = {
                "name": secret["name"],
                "key": item["key"],
                "optional": secret.get("optional", False),
            }
    return refs


def container_secret_files(r: Rendered, deployment: str) -> dict[str, str]:
    """The files Kubernetes puts in that folder, optional ones left out when missing."""
    secrets = _secret_values(r)
    files: dict[str, str] = {}
    for path, ref in secret_file_refs(r, deployment).items():
        value = secrets.get(ref["name"], {}).get(ref["key"])
        if value is None:
            assert ref["optional"], f"{path}: no key {ref['key']} in {ref['name']}"
            continue
        files[path] = value
    return files


def container_inputs(r: Rendered, deployment: str) -> dict[str, str]:
    """Every RATCHET_* value the service reads: its environment and its secret files."""
    return {**container_secret_files(r, deployment), **container_env(r, deployment)}


def _secret_values(r: Rendered) -> dict[str, dict[str, str]]:
    secrets = {
        s["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in s["data"].items()}
        for s in r.kinds("Secret")
    }
    secrets.update(EXISTING_SECRETS)
    return secrets


def _load_in_pod(
    r: Rendered, deployment: str, workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> RatchetSettings:
    """Settings as the container loads them: the rendered ratchet.yaml, its environment and
    its secret files."""
    unknown = set(r.config) - set(RatchetSettings.model_fields)
    assert not unknown, f"ratchet.yaml has keys settings do not know: {unknown}"
    path = workdir / "ratchet.yaml"
    path.write_text(r.ratchet_yaml)
    for name, value in container_env(r, deployment).items():
        monkeypatch.setenv(name, value)
    folder = workdir / f"secrets-{deployment}"
    folder.mkdir(exist_ok=True)
    for name, value in container_secret_files(r, deployment).items():
        (folder / name).write_text(value)
    monkeypatch.setenv("RATCHET_SECRETS_DIR", str(folder))
    return load_settings(path)


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_rendered_config_loads_with_the_proxy_env(
    rendered: dict[str, Rendered],
    values_file: str,
    clean_ratchet_env: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    r = rendered[values_file]
    settings = _load_in_pod(r, f"{FULLNAME}-proxy", clean_ratchet_env, monkeypatch)

    assert settings.proxy.host == "0.0.0.0"
    assert settings.proxy.port == 8400
    assert settings.auth_enabled
    assert settings.store_dir == Path("/adapters")
    assert settings.spool_dir == Path("/var/lib/ratchet/state/spool")
    assert set(settings.aliases) == set(load_values(values_file).get("aliases", {"support": {}}))
    keys = [k.get_secret_value() for k in settings.proxy.api_keys]
    assert keys and all(k.startswith("sk-SENTINEL") for k in keys)
    redis = parse_url(redis_connection_url(settings))
    kafka = settings.kafka.client_options()
    if values_file == "all-on":
        assert redis["password"] == "SENTINEL-redis-password"
        assert redis["username"] == "ratchet"
        assert redis["ssl_ca_certs"] == "/etc/ratchet/redis-ca/ca.crt"
        assert (redis["host"], redis["port"], redis["db"]) == (
            "my-redis.cache.example.com",
            6380,
            2,
        )
        assert kafka["sasl_plain_password"] == "SENTINEL-kafka-password"
        assert kafka["sasl_mechanism"] == "SCRAM-SHA-512"
        assert kafka["security_protocol"] == "SASL_SSL"
        assert settings.proxy.admin_key is not None
        assert settings.aliases["sql"].reward.ruler_weight == 0.3
        assert settings.kafka.topic_retention_ms == 86_400_000
        assert settings.kafka.session_timeout_ms == 10_000
    elif values_file == "existing-secrets":
        assert keys == ["sk-SENTINEL-op-1"]
        assert redis["password"] == "SENTINEL-op-redis"
        assert kafka["sasl_plain_password"] == "SENTINEL-op-kafka"
    elif values_file == "defaults":  # what the chart requires: SASL over TLS, a Redis password
        assert redis["password"] == "SENTINEL-redis-password"
        assert kafka["security_protocol"] == "SASL_SSL"
        assert kafka["sasl_plain_password"] == "SENTINEL-kafka-password"
    else:  # allowInsecure
        assert "password" not in redis
        default = ratchet_settings.KafkaSettings().session_timeout_ms
        assert settings.kafka.session_timeout_ms == default
        assert kafka == {"security_protocol": "PLAINTEXT"}


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_rendered_config_loads_with_the_judge_env(
    rendered: dict[str, Rendered],
    values_file: str,
    clean_ratchet_env: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The judge's pod starts: same ratchet.yaml, its own environment (no client keys)."""
    r = rendered[values_file]
    values = load_values(values_file)
    if not r.has("Deployment", f"{FULLNAME}-judge"):
        # The learner's gate reads the judge section too.
        assert ("judge" in r.config) == r.has("Deployment", f"{FULLNAME}-learner")
        return
    env = container_env(r, f"{FULLNAME}-judge")
    assert "RATCHET_PROXY__API_KEYS" not in env and "RATCHET_PROXY__ADMIN_KEY" not in env
    settings = _load_in_pod(r, f"{FULLNAME}-judge", clean_ratchet_env, monkeypatch)

    judge = settings.judge
    assert (judge.metrics_host, judge.metrics_port) == ("0.0.0.0", 8402)
    expected = {
        **ratchet_settings.JudgeSettings().model_dump(),
        **values.get("judge", {}).get("config", {}),
    }
    got = judge.model_dump()
    for name in set(expected) - CHART_OWNED["judge"]:
        assert got[name] == expected[name], name
    assert settings.vllm_url == r.config["vllm_url"]
    redis = parse_url(redis_connection_url(settings))
    kafka = settings.kafka.client_options()
    key = judge.judge_api_key.get_secret_value() if judge.judge_api_key else None
    if values_file == "all-on":
        assert key == "sk-SENTINEL-judge"
        assert judge.judge_api_base == "https://api.openai.com/v1"
        assert env["SQL_VERIFIER_DSN"] == "SENTINEL-verifier-dsn"
        assert redis["password"] == "SENTINEL-redis-password"
        assert redis["ssl_ca_certs"] == "/etc/ratchet/redis-ca/ca.crt"
        assert kafka["sasl_plain_password"] == "SENTINEL-kafka-password"
        assert kafka["ssl_cafile"] == "/etc/ratchet/kafka-ca/ca.crt"
    elif values_file == "existing-secrets":
        assert key == "sk-SENTINEL-op-judge"
        assert redis["password"] == "SENTINEL-op-redis"
        # Its own Kafka user (kafka.sasl.users.judge): ACLs can let it alone write groups.
        assert kafka["sasl_plain_username"] == "ratchet-judge"
        assert kafka["sasl_plain_password"] == "SENTINEL-op-judge-kafka"
    else:
        assert key is None
        assert judge.judge_api_base is None  # the release's vLLM
        if values_file == "defaults":
            assert redis["password"] == "SENTINEL-redis-password"
            assert kafka["sasl_plain_password"] == "SENTINEL-kafka-password"
        else:  # allowInsecure
            assert "password" not in redis
            assert kafka == {"security_protocol": "PLAINTEXT"}


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_rendered_config_loads_with_the_learner_env(
    rendered: dict[str, Rendered],
    values_file: str,
    clean_ratchet_env: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The learner's pod starts: its section has exactly LearnerSettings' keys (extra keys are
    refused at load), it trains the weights vLLM serves, and it gets the judge's key for the
    gate but no client keys."""
    r = rendered[values_file]
    values = load_values(values_file)
    if not r.has("Deployment", f"{FULLNAME}-learner"):
        assert "learner" not in r.config
        return
    section = r.config["learner"]
    assert set(section) <= set(ratchet_settings.LearnerSettings.model_fields)
    assert CHART_OWNED["learner"] <= set(section)
    env = container_env(r, f"{FULLNAME}-learner")
    assert "RATCHET_PROXY__API_KEYS" not in env and "RATCHET_PROXY__ADMIN_KEY" not in env
    settings = _load_in_pod(r, f"{FULLNAME}-learner", clean_ratchet_env, monkeypatch)

    learner = settings.learner
    assert (learner.metrics_host, learner.metrics_port) == ("0.0.0.0", 8403)
    # The value vLLM was started with (--model): adapters must name it as their base.
    assert learner.base_model_path == values["model"]["name"]
    if r.has("Deployment", f"{FULLNAME}-vllm"):
        assert learner.base_model_path == r.container(f"{FULLNAME}-vllm")["args"][0]
    gpus = r.container(f"{FULLNAME}-learner")["resources"]["limits"].get("nvidia.com/gpu", 0)
    configured = values.get("learner", {}).get("config", {})
    assert learner.device == configured.get("device", "cuda" if gpus else "auto")
    expected = _merged(
        _merged(
            ratchet_settings.LearnerSettings().model_dump(), CHART_DEFAULTS["learner"]["config"]
        ),
        configured,
    )
    got = learner.model_dump()
    for name in set(expected) - CHART_OWNED["learner"] - {"device"}:
        assert got[name] == expected[name], name
    assert settings.store_dir == Path(r.config["store_dir"])
    assert settings.vllm_url == r.config["vllm_url"]
    key = settings.judge.judge_api_key
    key = key.get_secret_value() if key else None
    if values_file == "all-on":
        assert key == "sk-SENTINEL-judge"
        assert settings.judge.judge_api_base == "https://api.openai.com/v1"
        assert env["SQL_VERIFIER_DSN"] == "SENTINEL-verifier-dsn"
        assert parse_url(redis_connection_url(settings))["password"] == "SENTINEL-redis-password"
        assert settings.kafka.client_options()["sasl_plain_password"] == "SENTINEL-kafka-password"
    elif values_file == "existing-secrets":
        assert key == "sk-SENTINEL-op-judge"
        assert parse_url(redis_connection_url(settings))["password"] == "SENTINEL-op-redis"
        kafka = settings.kafka.client_options()
        assert kafka["sasl_plain_username"] == "ratchet-learner"  # kafka.sasl.users.learner
        assert kafka["sasl_plain_password"] == "SENTINEL-op-learner-kafka"
    else:
        assert key is None
    if values_file == "gpu-learner":
        assert env["HF_TOKEN"] == "hf_SENTINEL-learner"


def test_alias_values_mirror_the_settings(chart: helm.Chart) -> None:
    """values.schema.json (generated: python -m ratchet.settings.generate) describes an alias
    and the proxy, judge and learner sections with exactly the fields ratchet/settings/ has
    (less those the chart sets or takes from a Secret), with the same bounds and choices."""
    schema = chart.schema
    assert schema is not None
    _same_fields(schema["definitions"]["alias"], ratchet_settings.AliasConfig, "aliases.<name>")
    for section, model in SECTIONS.items():
        config = schema["properties"][section]["properties"]["config"]
        assert config["additionalProperties"] is False, section
        fields = set(model.model_fields)
        assert CHART_OWNED[section] <= fields, section
        assert set(config["properties"]) == fields - CHART_OWNED[section], section
        for name in config["properties"]:
            field = model.model_fields[name]
            sub = field.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                _same_fields(config["properties"][name], sub, f"{section}.{name}")
            else:
                _same_bounds(config["properties"][name], field, f"{section}.{name}")
    kafka = schema["properties"]["kafka"]["properties"]
    fields = ratchet_settings.KafkaSettings.model_fields
    assert set(kafka["securityProtocol"]["enum"]) == _literals(fields["security_protocol"])
    assert set(kafka["sasl"]["properties"]["mechanism"]["enum"]) - {""} == _literals(
        fields["sasl_mechanism"]
    )
    assert set(kafka["compression"]["enum"]) == _literals(fields["compression"])
    assert set(kafka["idempotence"]["enum"]) == _literals(fields["idempotence"])


def test_values_config_blocks_hold_only_the_charts_decisions(
    chart: helm.Chart, rendered: dict[str, Rendered]
) -> None:
    """values.yaml repeats no setting's default: each key under a `<service>.config` block is a
    setting the service accepts there (one the chart does not set itself), and it and each Kafka
    value it sets are one of CHART_DECISIONS, and each of those is there."""
    sections = {**SECTIONS, "console": ratchet_settings.ConsoleSettings}
    found = set()
    kafka_values = chart.values["kafka"]
    for dotted in KAFKA_VALUES:
        parent, _, leaf = dotted.rpartition(".")
        if leaf in (kafka_values.get(parent, {}) if parent else kafka_values):
            assert ("kafka", dotted) in CHART_DECISIONS, (
                f"values.yaml sets kafka.{dotted}: leave it out so the services' default applies, "
                "or add it to CHART_DECISIONS with why the chart decides otherwise"
            )
            found.add(("kafka", dotted))
    # Each Kafka value reaches ratchet.yaml when given, and only then.
    given = load_values("all-on")["kafka"]
    for dotted, setting in KAFKA_VALUES.items():
        parent, _, leaf = dotted.rpartition(".")
        value = (given[parent] if parent else given)[leaf]
        assert rendered["all-on"].config["kafka"][setting] == value, dotted
    assert "topic_partitions" not in rendered["defaults"].config["kafka"]
    for section, model in sections.items():
        config = chart.values[section]["config"]
        settable = set(model.model_fields) - CHART_OWNED[section]
        unknown = set(config) - settable
        assert not unknown, f"{section}.config: {unknown} are not settings values may set"
        model.model_validate(config)  # values the service accepts
        for name in config:
            assert (section, name) in CHART_DECISIONS, (
                f"values.yaml sets {section}.config.{name}: leave it out so the service's default "
                "applies, or add it to CHART_DECISIONS with why the chart decides otherwise"
            )
            found.add((section, name))
    assert found == CHART_DECISIONS, "a chart decision that values.yaml no longer makes"
    # A chart decision that differs from the service's default shows in a release's config.
    rendered = render(chart, REQUIRED).config
    assert (
        rendered["proxy"]["redact_patterns"] == chart.values["proxy"]["config"]["redact_patterns"]
    )
    assert ratchet_settings.ProxySettings().redact_patterns != rendered["proxy"]["redact_patterns"]


def _same_fields(schema: dict[str, Any], model: type[BaseModel], where: str) -> None:
    assert schema["additionalProperties"] is False, where
    fields = model.model_fields
    assert set(schema["properties"]) == set(fields), where
    for name, field in fields.items():
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            _same_fields(schema["properties"][name], sub, f"{where}.{name}")
        else:
            _same_bounds(schema["properties"][name], field, f"{where}.{name}")


# pydantic's bound constraints and the JSON-schema keywords that say the same.
_BOUNDS = {
    "ge": "minimum",
    "gt": "exclusiveMinimum",
    "le": "maximum",
    "lt": "exclusiveMaximum",
}


def _same_bounds(schema: dict[str, Any], field: Any, where: str) -> None:
    """The schema refuses what the settings refuse: the same numeric bounds and choices."""
    bounds = {
        keyword: getattr(meta, attr)
        for meta in field.metadata
        for attr, keyword in _BOUNDS.items()
        if hasattr(meta, attr)
    }
    assert {k: schema[k] for k in _BOUNDS.values() if k in schema} == bounds, where
    literals = _literals(field)
    if literals:
        choices = set(schema.get("enum", ()))
        for option in schema.get("anyOf", ()):
            choices |= set(option.get("enum", ())) | (
                {option["const"]} if "const" in option else set()
            )
        assert choices - {""} == literals, where


def _literals(field: Any) -> set[str]:
    """The values of a Literal[...] field, also inside Literal[...] | None."""
    annotation = field.annotation
    if typing.get_origin(annotation) is typing.Literal:
        return set(typing.get_args(annotation))
    values: set[str] = set()
    for arg in typing.get_args(annotation):
        if typing.get_origin(arg) is typing.Literal:
            values |= set(typing.get_args(arg))
    return values


# ---- bad values ------------------------------------------------------------------------------

REQUIRED = {
    "model": {"name": "Qwen/Qwen2.5-1.5B-Instruct"},
    # Without the opt-outs the chart also requires SASL over TLS and a Redis password (tested
    # below); the other checks are tested on the smallest values.
    "kafka": {
        "bootstrapServers": "kafka:9092",
        "securityProtocol": "PLAINTEXT",
        "allowInsecure": True,
    },
    "redis": {"url": "redis://redis:6379/0", "allowInsecure": True},
    "proxy": {"apiKeys": ["sk-1"]},
}


def _merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``override`` over ``base``, nested mappings merged as Helm merges values files."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merged(merged[key], value)
        else:
            merged[key] = value
    return merged


def _with(path: str, value: Any) -> dict[str, Any]:
    values = json.loads(json.dumps(REQUIRED))
    *parents, leaf = path.split(".")
    node = values
    for part in parents:
        node = node.setdefault(part, {})
    if value is _DELETE:
        node.pop(leaf)
    else:
        node[leaf] = value
    return values


_DELETE = object()

BAD_VALUES = [
    # (path, value, what the message must say)
    ("model.name", _DELETE, ["/model", "missing property 'name'"]),
    ("kafka.bootstrapServers", _DELETE, ["/kafka", "missing property 'bootstrapServers'"]),
    ("redis.url", _DELETE, ["/redis", "missing property 'url'"]),
    ("kafka.bootstrapServers", 9092, ["/kafka/bootstrapServers", "want string"]),
    ("proxy.replicaCount", "2", ["/proxy/replicaCount", "got string, want integer"]),
    ("vllm.enabled", "yes", ["/vllm/enabled", "want boolean"]),
    ("secret.create", "yes", ["/secret/create", "want boolean"]),
    ("secret.existingSecret", "Not A Name", ["/secret/existingSecret", "does not match pattern"]),
    ("secret.vllmApiKey", "sk-1", ["/secret", "additional properties 'vllmApiKey' not allowed"]),
    ("kafka.topics", {"partitions": 0}, ["/kafka/topics/partitions", "minimum"]),
    ("kafka.securityProtocol", "TLS", ["/kafka/securityProtocol", "SASL_SSL"]),
    ("proxyy", {}, ["additional properties 'proxyy' not allowed"]),
    (
        "aliases",
        {"support": {"learning": {"sample_rat": 0.5}}},
        ["/aliases/support/learning", "additional properties 'sample_rat' not allowed"],
    ),
    ("aliases", {"Support!": {}}, ["invalid propertyName 'Support!'", "does not match pattern"]),
    ("aliases", {"support": {"log_rate": 1.5}}, ["/aliases/support/log_rate", "maximum"]),
    ("redis.url", "redis://:hunter2@redis:6379/0", ["/redis/url", "does not match pattern"]),
    ("vllm.enabled", False, ["/vllm", "missing property 'url'"]),
    ("vllm.maxLoraRank", 48, ["/vllm/maxLoraRank"]),
    ("learner.gpu", {"count": -1}, ["/learner/gpu/count", "minimum"]),
    ("proxy.config", {"upstream_timeout": 5}, ["/proxy/config", "'upstream_timeout' not allowed"]),
    ("judge.config", {"concurency": 8}, ["/judge/config", "'concurency' not allowed"]),
    ("judge.config", {"concurrency": 0}, ["/judge/config/concurrency", "minimum"]),
    # The judge-model key belongs in a Secret, never in the ConfigMap.
    ("judge.config", {"judge_api_key": "sk-1"}, ["/judge/config", "'judge_api_key' not allowed"]),
    ("learner.config", {"batch_group": 8}, ["/learner/config", "'batch_group' not allowed"]),
    # The chart sets the base model from model.name: the one vLLM serves.
    (
        "learner.config",
        {"base_model_path": "other/model"},
        ["/learner/config", "'base_model_path' not allowed"],
    ),
    ("learner.config", {"device": "tpu"}, ["/learner/config/device", "'auto', 'cpu', 'cuda'"]),
    ("learner.config", {"lora": {"rank": 64}}, ["/learner/config/lora/rank", "maximum"]),
    (
        "learner.config",
        {"lora": {"target_modules": "all"}},
        ["/learner/config/lora/target_modules", "value must be 'all-linear'"],
    ),
    ("learner.startupProbe", {"periodSeconds": 0}, ["/learner/startupProbe/periodSeconds"]),
    ("learner.image", {"pullPolicy": "Sometimes"}, ["/learner/image/pullPolicy", "IfNotPresent"]),
    (
        "aliases",
        {"support": {"canary": {"weight": 1.0}}},
        ["/aliases/support/canary/weight", "exclusiveMaximum"],
    ),
    (
        "aliases",
        {"support": {"gate": {"alpha": 0.5}}},
        ["/aliases/support/gate/alpha", "exclusiveMaximum"],
    ),
]


@pytest.mark.parametrize(("path", "value", "expected"), BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_schema_refuses_bad_values(
    chart: helm.Chart, path: str, value: Any, expected: list[str]
) -> None:
    with pytest.raises(helm.HelmValuesError) as exc:
        render(chart, _with(path, value))
    message = str(exc.value)
    for part in expected:
        assert part in message, message
    # `helm lint` reports the same problem.
    report = helm.lint(CHART, _with(path, value), strict=True)
    assert any(expected[-1] in e for e in report["errors"]), report["errors"]


_DEFAULT_RANK = ratchet_settings.LearnerSettings().lora.rank
_DEFAULT_MAX_PAIRS = ratchet_settings.AliasConfig().gate.max_pairs

TEMPLATE_CHECKS = [
    (
        {"kafka": {"allowInsecure": False}},
        "kafka.securityProtocol is PLAINTEXT: whoever reaches the brokers could write the groups",
    ),
    (
        {"kafka": {"allowInsecure": False, "securityProtocol": "SSL"}},
        "kafka.securityProtocol is SSL: whoever reaches the brokers",
    ),
    (
        {"kafka": {"securityProtocol": "SASL_SSL"}},
        "kafka.securityProtocol is SASL_SSL but kafka.sasl.mechanism is empty",
    ),
    ({"redis": {"allowInsecure": False}}, "redis has no password: whoever reaches Redis"),
    ({"proxy": {"apiKeys": []}}, "proxy.apiKeys is empty and proxy.existingSecret is not set"),
    (
        {"vllm": {"enabled": True, "url": "http://vllm:8000"}},
        "vllm.url is set while vllm.enabled is true",
    ),
    (
        {"kafka": {"sasl": {"mechanism": "PLAIN", "username": "u"}}},
        "kafka.sasl.mechanism is set but there is no password",
    ),
    (
        {"kafka": {"sasl": {"mechanism": "PLAIN", "username": "u", "password": "p"}}},
        "kafka.securityProtocol is not SASL_PLAINTEXT or SASL_SSL",
    ),
    (
        {"redis": {"tls": {"caSecret": "ca"}}},
        "redis.url does not start with rediss://",
    ),
    (
        {"judge": {"existingSecret": "mine", "apiKey": "sk-1"}},
        "judge.existingSecret is set together with judge.apiKey or judge.providerKeys",
    ),
    (
        {"judge": {"apiKey": "sk-1", "providerKeys": {"RATCHET_JUDGE__JUDGE_API_KEY": "sk-2"}}},
        "judge.apiKey and judge.providerKeys.RATCHET_JUDGE__JUDGE_API_KEY are both set",
    ),
    # The learner's gate reads the judge's Secret even when the judge runs elsewhere.
    (
        {"judge": {"enabled": False, "existingSecret": "mine", "apiKey": "sk-1"}},
        "judge.existingSecret is set together with judge.apiKey or judge.providerKeys",
    ),
    (
        {"vllm": {"enabled": False, "url": "http://vllm:8000"}},
        "learner.enabled is true with an existing vLLM (vllm.enabled=false) but "
        "adapters.existingClaim is empty",
    ),
    (
        {"learner": {"config": {"lora": {"rank": 32}}}, "vllm": {"maxLoraRank": 16}},
        "learner.config.lora.rank (32) is above vllm.maxLoraRank (16)",
    ),
    # A rank left out is the learner's default (_settings-defaults.tpl, generated), not a copy.
    (
        {"vllm": {"maxLoraRank": 1}},
        f"learner.config.lora.rank ({_DEFAULT_RANK}) is above vllm.maxLoraRank (1)",
    ),
    # max_pairs left out is the gate's default, as the service reads it.
    (
        {"aliases": {"support": {"gate": {"min_pairs": _DEFAULT_MAX_PAIRS + 1}}}},
        f"aliases.support.gate.max_pairs ({_DEFAULT_MAX_PAIRS}) is below gate.min_pairs "
        f"({_DEFAULT_MAX_PAIRS + 1}): no gate could ever pass. Raise max_pairs "
        f"(default {_DEFAULT_MAX_PAIRS})",
    ),
]


@pytest.mark.parametrize(
    ("override", "expected"), TEMPLATE_CHECKS, ids=[c[1] for c in TEMPLATE_CHECKS]
)
def test_template_refuses_inconsistent_values(
    chart: helm.Chart, override: dict[str, Any], expected: str
) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(expected)):
        render(chart, _merged(REQUIRED, override))


def test_consistent_values_pass_those_checks(chart: helm.Chart) -> None:
    """The same values made consistent render: each check above refuses only what it names."""
    for override in [
        {"judge": {"enabled": False, "existingSecret": "mine"}},
        {"vllm": {"enabled": False, "url": "http://v:8000"}, "adapters": {"existingClaim": "a"}},
        {"vllm": {"enabled": False, "url": "http://v:8000"}, "learner": {"enabled": False}},
        {"learner": {"config": {"lora": {"rank": 16}}}, "vllm": {"maxLoraRank": 16}},
        {"aliases": {"support": {"gate": {"min_pairs": 100, "max_pairs": 100}}}},
        # The defaults pass, as the service accepts them.
        {"aliases": {"support": {"gate": {"min_pairs": _DEFAULT_MAX_PAIRS}}}},
        {"vllm": {"maxLoraRank": _DEFAULT_RANK}},
        # Secure backends need no opt-out.
        {
            "kafka": {
                "allowInsecure": False,
                "securityProtocol": "SASL_SSL",
                "sasl": {"mechanism": "PLAIN", "username": "u", "password": "p"},
            },
            "redis": {"allowInsecure": False, "auth": {"password": "p"}},
        },
    ]:
        assert render(chart, _merged(REQUIRED, override)).objects


def test_every_values_file_passes_the_schema(chart: helm.Chart) -> None:
    for name in VALUES_FILES:
        chart.validate_schema(chart.merge_values(load_values(name)))
