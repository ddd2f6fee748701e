"""ratchet.settings: defaults, precedence (kwargs > RATCHET_* env > yaml), validation messages."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from embedded.config import default_config_text
from proxy.app import create_app
from ratchet.settings import (
    DEFAULT_BASE_MODEL,
    MOVED_KEYS,
    AliasConfig,
    ConfigError,
    LearnerSettings,
    RatchetSettings,
    load_settings,
)


def write_yaml(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ratchet.yaml that RATCHET_CONFIG points at; tests write its content."""
    path = tmp_path / "ratchet.yaml"
    monkeypatch.setenv("RATCHET_CONFIG", str(path))
    return path


def test_defaults(tmp_path: Path) -> None:
    s = load_settings()
    assert s.kafka_bootstrap_servers == "127.0.0.1:9092"
    assert s.redis_url == "redis://127.0.0.1:6399/0"
    assert s.vllm_url == "http://127.0.0.1:8401"
    assert s.proxy.host == "127.0.0.1"
    assert s.proxy.port == 8400
    assert s.proxy.api_keys == []
    assert s.auth_enabled is False
    assert s.proxy.max_body_bytes == 4 * 1024 * 1024
    assert list(s.aliases) == ["support"]
    support = s.aliases["support"]
    assert support.base_model == DEFAULT_BASE_MODEL
    assert support.reward.kind == "ruler"
    assert support.reward.verifier is None
    assert support.learning.group_size == 6
    assert support.gate.min_pairs == 32
    assert support.canary.weight == pytest.approx(0.1)
    assert s.kafka.security_protocol == "PLAINTEXT"
    # RATCHET_HOME (set by conftest) moves every derived path.
    home = tmp_path / "home"
    assert s.home == home
    assert s.store_dir == home / "adapters"
    assert s.state_dir == home / "state"
    assert s.spool_dir == home / "state" / "spool"


def test_the_packaged_config_tunes_nothing_per_task() -> None:
    """`ratchet up`'s ratchet.yaml leaves learning to the defaults: a user who starts from it and
    one who starts from an empty file get the same loop, and the demo gets what a new task gets."""
    import yaml

    from embedded.config import default_config_text

    packaged = yaml.safe_load(default_config_text())
    assert "learner" not in packaged
    for name, alias in packaged["aliases"].items():
        assert set(alias) <= {"reward"}, name


def test_explicit_dirs_are_not_derived(tmp_path: Path) -> None:
    s = RatchetSettings(store_dir=tmp_path / "store", state_dir=tmp_path / "st")
    assert s.store_dir == tmp_path / "store"
    assert s.spool_dir == tmp_path / "st" / "spool"


def test_yaml_is_read(config: Path) -> None:
    write_yaml(
        config,
        "vllm_url: http://vllm:8000\n"
        "proxy: {port: 9000}\n"
        "aliases:\n  billing: {base_model: other-model, canary: {weight: 0.3}}\n",
    )
    s = load_settings()
    assert s.vllm_url == "http://vllm:8000"
    assert s.proxy.port == 9000
    assert s.aliases["billing"].base_model == "other-model"
    assert s.aliases["billing"].canary.weight == pytest.approx(0.3)


def test_env_overrides_yaml(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_yaml(
        config,
        "vllm_url: http://from-yaml:1\nredis_url: redis://from-yaml:2/0\n"
        "proxy: {port: 9000, host: '::1', max_body_bytes: 2048}\n",
    )
    monkeypatch.setenv("RATCHET_VLLM_URL", "http://from-env:3")
    monkeypatch.setenv("RATCHET_PROXY__PORT", "9100")
    s = load_settings()
    assert s.vllm_url == "http://from-env:3"
    assert s.redis_url == "redis://from-yaml:2/0"  # not overridden: yaml still applies
    assert s.proxy.port == 9100
    # A nested env var overrides one key, not the whole yaml section.
    assert s.proxy.host == "::1"
    assert s.proxy.max_body_bytes == 2048


def test_nested_env_without_yaml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RATCHET_PROXY__PORT", "9001")
    monkeypatch.setenv("RATCHET_KAFKA__COMPRESSION", "none")
    monkeypatch.setenv("RATCHET_ALIASES__SUPPORT__LOG_RATE", "0.25")
    s = load_settings()
    assert s.proxy.port == 9001
    assert s.kafka.compression == "none"
    assert s.aliases["support"].log_rate == pytest.approx(0.25)
    assert s.aliases["support"].base_model == DEFAULT_BASE_MODEL


def test_keyword_overrides_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RATCHET_VLLM_URL", "http://from-env:3")
    assert load_settings(vllm_url="http://kwarg:4").vllm_url == "http://kwarg:4"


def test_api_keys_from_env_enable_auth_and_stay_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RATCHET_PROXY__API_KEYS", '["sk-one", "sk-two"]')
    monkeypatch.setenv("RATCHET_PROXY__HOST", "0.0.0.0")
    s = load_settings()
    assert s.auth_enabled
    assert [k.get_secret_value() for k in s.proxy.api_keys] == ["sk-one", "sk-two"]
    assert "sk-one" not in repr(s)
    assert "sk-one" not in s.model_dump_json()


def test_config_path_argument(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "elsewhere.yaml", "proxy: {port: 9555}\n")
    assert load_settings(path).proxy.port == 9555


def test_missing_config_path_argument(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=r"nope\.yaml"):
        load_settings(missing)


def test_missing_ratchet_config_file_rejected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An explicit RATCHET_CONFIG that names no file is a typo, not a request for defaults."""
    missing = tmp_path / "typo.yaml"
    monkeypatch.setenv("RATCHET_CONFIG", str(missing))
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert "typo.yaml" in str(info.value)


def test_cwd_ratchet_yaml_is_the_fallback() -> None:
    Path("ratchet.yaml").write_text("proxy: {port: 9333}\n")
    assert load_settings().proxy.port == 9333


@pytest.mark.parametrize(
    "name",
    [
        "Support",  # upper case
        "-support",  # must start with a letter or digit
        ".support",
        "sup port",
        "support@v1",  # the served-name form is not an alias
        "a" * 65,  # too long
        "sup/port",
        "support\n",  # a trailing newline must not slip through `$`
    ],
)
def test_bad_alias_names_rejected(name: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(aliases={name: {}})
    assert "aliases" in str(info.value)


@pytest.mark.parametrize("name", ["a", "support", "a" * 64, "x1.y_z-2", "0day"])
def test_good_alias_names_accepted(name: str) -> None:
    assert name in load_settings(aliases={name: {}}).aliases


def test_bad_alias_name_from_yaml_rejected(config: Path) -> None:
    write_yaml(config, "aliases:\n  Support: {}\n")
    with pytest.raises(ConfigError, match="Support"):
        load_settings()


@pytest.mark.parametrize("kind", ["verifier", "mixed"])
def test_verifier_kind_without_verifier_rejected(kind: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(aliases={"math": {"reward": {"kind": kind}}})
    message = str(info.value)
    assert "aliases.math.reward" in message
    assert "reward.verifier" in message


@pytest.mark.parametrize(
    ("reward", "expected"),
    [
        ({"kind": "feedback"}, "reward.kind is 'feedback' but canary.weight is 0"),
        (
            {"kind": "mixed", "verifier": "m:f", "feedback_weight": 0.3},
            "reward.feedback_weight is above 0 but canary.weight is 0",
        ),
    ],
)
def test_learning_from_ratings_refuses_an_alias_without_a_canary(
    reward: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_settings(aliases={"rated": {"reward": reward, "canary": {"weight": 0}}})
    rated = load_settings(aliases={"rated": {"reward": reward, "canary": {"weight": 0.1}}})
    assert rated.aliases["rated"].reward.learns_from_ratings


def test_a_feedback_weight_belongs_to_kind_mixed() -> None:
    with pytest.raises(ConfigError, match="weighs the reward model inside kind: mixed"):
        load_settings(aliases={"rated": {"reward": {"kind": "ruler", "feedback_weight": 0.5}}})
    assert not load_settings(aliases={"a": {}}).aliases["a"].reward.learns_from_ratings


def test_verifier_must_name_a_function() -> None:
    with pytest.raises(ConfigError, match=r"package\.module:function"):
        load_settings(aliases={"math": {"reward": {"kind": "verifier", "verifier": "pkg.mod"}}})
    s = load_settings(aliases={"math": {"reward": {"kind": "verifier", "verifier": "pkg.mod:fn"}}})
    assert s.aliases["math"].reward.verifier == "pkg.mod:fn"


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("ratchet.demo:extraction_reward", "tasks.demo:extraction_reward"),
        ("ratchet.demo.verifier:score", "tasks.demo.verifier:score"),
        ("ratchet.tasks.sorting:sorting_reward", "tasks.sorting:sorting_reward"),
    ],
)
def test_a_verifier_of_the_bundled_tasks_old_place_names_its_new_one(old: str, new: str) -> None:
    """The bundled tasks left the kernel (ratchet.demo, ratchet.tasks.X -> tasks.demo, tasks.X):
    an old ratchet.yaml is told the new reference at load, not an import error at start-up."""
    with pytest.raises(ConfigError, match=rf"reward.verifier '{old}' moved: use '{new}'"):
        load_settings(aliases={"math": {"reward": {"kind": "verifier", "verifier": old}}})
    near = "ratchet.demos:extraction_reward"  # only the moved packages, not a name alike
    assert load_settings(aliases={"m": {"reward": {"kind": "verifier", "verifier": near}}})


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "proxy.example.com"])
def test_auth_off_on_non_loopback_rejected(host: str) -> None:
    settings = load_settings(proxy={"host": host})  # the judge and learner may load this
    with pytest.raises(ConfigError) as info:
        settings.check_proxy_exposure()  # the proxy may not serve it
    assert "proxy.api_keys" in str(info.value)
    assert host in str(info.value)
    with pytest.raises(ConfigError):
        create_app(settings)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_auth_off_on_loopback_allowed(host: str) -> None:
    assert load_settings(proxy={"host": host}).auth_enabled is False


def test_auth_on_allows_any_host() -> None:
    s = load_settings(proxy={"host": "0.0.0.0", "api_keys": ["sk-x"]})
    assert s.auth_enabled


@pytest.mark.parametrize(
    ("yaml_text", "where"),
    [
        ("bogus_key: 1\n", "bogus_key"),
        ("proxy: {prot: 9000}\n", "proxy.prot"),
        ("kafka: {compresion: gzip}\n", "kafka.compresion"),
        ("aliases:\n  support: {canary: {wieght: 0.2}}\n", "aliases.support.canary.wieght"),
    ],
)
def test_unknown_yaml_key_rejected(config: Path, yaml_text: str, where: str) -> None:
    write_yaml(config, yaml_text)
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert where in str(info.value)


def test_error_names_setting_and_env_var_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RATCHET_PROXY__PORT", "not-a-port")
    with pytest.raises(ConfigError) as info:
        load_settings()
    message = str(info.value)
    assert "proxy.port" in message
    assert "RATCHET_PROXY__PORT" in message


def test_error_names_setting_env_var_and_file_from_yaml(config: Path) -> None:
    write_yaml(config, "proxy: {port: 70000}\naliases:\n  support: {log_rate: 2}\n")
    with pytest.raises(ConfigError) as info:
        load_settings()
    message = str(info.value)
    # One line per bad setting, each naming the setting, its env var and the file.
    assert "proxy.port" in message
    assert "RATCHET_PROXY__PORT" in message
    assert "aliases.support.log_rate" in message
    assert "RATCHET_ALIASES__SUPPORT__LOG_RATE" in message
    assert str(config) in message


def test_bad_redact_pattern_rejected() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(proxy={"redact_patterns": ["(unclosed"]})
    assert "proxy.redact_patterns" in str(info.value)


@pytest.mark.parametrize("pattern", [r"(\w+)=\1", r"token(?=[0-9])", r"(?<!x)y"])
def test_a_pattern_re2_cannot_run_in_linear_time_is_refused(pattern: str) -> None:
    """Backreferences and lookaround need backtracking: refused at start, naming the fix."""
    with pytest.raises(ConfigError) as info:
        load_settings(proxy={"redact_patterns": [r"sk-[A-Za-z0-9]{8,}", pattern]})
    message = str(info.value)
    assert "proxy.redact_patterns" in message and repr(pattern) in message
    assert "RE2" in message and "without backreferences or lookaround" in message


def test_the_shipped_redact_patterns_compile() -> None:
    root = Path(__file__).resolve().parents[3]
    for path, section in (
        (root / "embedded/ratchet.yaml", lambda doc: doc["proxy"]),
        (root / "helm/ratchet/values.yaml", lambda doc: doc["proxy"]["config"]),
    ):
        patterns = section(yaml.safe_load(path.read_text()))["redact_patterns"]
        assert patterns and load_settings(proxy={"redact_patterns": patterns})


def test_cross_field_error_names_real_env_vars_only() -> None:
    """A whole-settings error must not point the operator at a bare ``RATCHET_`` variable."""
    with pytest.raises(ConfigError) as info:
        load_settings(proxy={"host": "0.0.0.0"}).check_proxy_exposure()
    names = re.findall(r"RATCHET_[A-Z0-9_]*", str(info.value))
    assert names, "the message should name the variable to set"
    assert all(n != "RATCHET_" for n in names), str(info.value)


def test_a_config_file_read_once_is_not_inherited(tmp_path: Path) -> None:
    """Found by a full run: a later RatchetSettings() picked up the file an earlier call read."""
    other = tmp_path / "other.yaml"
    other.write_text("aliases:\n  other: {}\nvllm_url: http://127.0.0.1:1\n")
    assert set(load_settings(other).aliases) == {"other"}
    fresh = RatchetSettings()
    assert set(fresh.aliases) == {"support"} and fresh.vllm_url == "http://127.0.0.1:8401"


def test_a_held_out_pool_smaller_than_the_gate_needs_is_refused() -> None:
    gate = {"min_pairs": 40, "max_pairs": 64}
    with pytest.raises(ConfigError) as info:
        load_settings(aliases={"a": {"gate": gate}}, learner={"heldout_pool": 32})
    assert "aliases.a.gate.min_pairs" in str(info.value)
    assert "learner.heldout_pool" in str(info.value)
    # an alias that does not learn needs no pool
    load_settings(
        aliases={"a": {"gate": gate, "learning": {"enabled": False}}}, learner={"heldout_pool": 32}
    )


# What the trainer's configs (learner/trainer.py, learner/loss.py) once refused themselves; the
# settings, which build them, refuse it at load.
BAD_TRAINING_KNOBS = [
    ("steps_per_round", 0),
    ("micro_batch_tokens", 0),
    ("learning_rate", 0.0),
    ("max_grad_norm", -1.0),
    ("weight_decay", -0.1),
    ("lora.rank", 0),
    ("lora.alpha", 0),
    ("lora.dropout", 1.0),
    ("loss.scale_rewards", "rank"),
    ("loss.mode", "reinforce"),
    ("loss.epsilon_low", 1.0),
    ("loss.epsilon_high", -0.1),
    ("loss.cispo_max_weight", 0.0),
    ("loss.kl_beta", -1.0),
]


@pytest.mark.parametrize(
    ("knob", "value"), BAD_TRAINING_KNOBS, ids=[k for k, _ in BAD_TRAINING_KNOBS]
)
def test_bad_training_knobs_are_refused_by_name(knob: str, value: Any) -> None:
    *sections, leaf = knob.split(".")
    learner: dict[str, Any] = {leaf: value}
    for section in reversed(sections):
        learner = {section: learner}
    with pytest.raises(ConfigError) as info:
        load_settings(learner=learner)
    assert f"learner.{knob}" in str(info.value)
    assert f"RATCHET_LEARNER__{knob.upper().replace('.', '__')}" in str(info.value)


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_a_flat_lora_or_loss_key_of_an_old_config_names_its_new_place(
    old: str, config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """learner.lora_rank and the like moved into learner.lora and learner.loss: an old
    ratchet.yaml, or an old environment variable, is told where each went."""
    section, key = MOVED_KEYS[old].split(".")
    value = LearnerSettings().model_dump(mode="json")[section][key]
    write_yaml(config, yaml.safe_dump({"learner": {old: value}}))
    with pytest.raises(ConfigError, match=rf"learner\.{old} is now learner\.{MOVED_KEYS[old]}"):
        load_settings()
    write_yaml(config, "")
    monkeypatch.setenv(f"RATCHET_LEARNER__{old.upper()}", json.dumps(value))
    with pytest.raises(ConfigError, match=rf"learner\.{old} is now learner\.{MOVED_KEYS[old]}"):
        load_settings()


def test_lora_and_loss_are_set_nested(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_yaml(config, "learner: {lora: {rank: 16}, loss: {mode: cispo}}\n")
    learner = load_settings().learner
    assert (learner.lora.rank, learner.lora.alpha) == (16, 16)
    assert (learner.loss.mode, learner.loss.kl_beta) == ("cispo", 0.0)
    monkeypatch.setenv("RATCHET_LEARNER__LOSS__KL_BETA", "0.05")
    assert load_settings().learner.loss.kl_beta == 0.05


def test_weight_decay_is_settable(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert RatchetSettings().learner.weight_decay == 0.0
    write_yaml(config, "learner: {weight_decay: 0.01}\n")
    assert load_settings().learner.weight_decay == 0.01
    monkeypatch.setenv("RATCHET_LEARNER__WEIGHT_DECAY", "0.02")
    assert load_settings().learner.weight_decay == 0.02


def _repeated_defaults(data: dict[str, Any], defaults: BaseModel, where: str) -> list[str]:
    """The keys of ``data`` whose value is the one ``defaults`` already has."""
    repeated = []
    for key, value in data.items():
        default = getattr(defaults, key)
        if key == "aliases":
            for name, alias in value.items():
                repeated += _repeated_defaults(alias, AliasConfig(), f"{where}aliases.{name}.")
        elif isinstance(default, BaseModel):
            repeated += _repeated_defaults(value, default, f"{where}{key}.")
        elif value == default:
            repeated.append(f"{where}{key}")
    return repeated


def test_the_packaged_config_loads_and_repeats_no_default(tmp_path: Path) -> None:
    """embedded/ratchet.yaml (what `ratchet up` writes) sets what differs from the defaults
    in ratchet/settings.py, and nothing else: a repeated default is a second copy to drift."""
    text = default_config_text()
    settings = load_settings(write_yaml(tmp_path / "ratchet.yaml", text))
    assert set(settings.aliases) == {"support", "demo"}
    assert settings.aliases["demo"].reward.verifier == "tasks.demo:extraction_reward"
    assert _repeated_defaults(yaml.safe_load(text), RatchetSettings(), "") == []


@pytest.mark.parametrize(
    ("variable", "value", "named"),
    [
        ("RATCHET_LEARNER__LEASE_TTL_S", "0.1", "learner.lease_ttl_s"),
        ("RATCHET_JUDGE__DONE_TTL_S", "-1", "judge.done_ttl_s"),
    ],
)
def test_replica_settings_are_checked_by_name(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, named: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert named in str(info.value) and variable in str(info.value)


def test_replica_settings_defaults() -> None:
    settings = load_settings()
    assert settings.learner.lease_ttl_s == 30.0
    assert settings.judge.done_ttl_s == 3600


def test_secrets_come_from_a_folder_of_files_named_as_their_variables(
    tmp_path: Path, config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Kubernetes Secret mounted as a volume: one file per setting, the environment keeps no
    secret. The environment still overrides a file, and a file overrides ratchet.yaml."""
    write_yaml(config, "redis_password: from-yaml\nproxy: {admin_key: from-yaml}\n")
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "RATCHET_SECRET").write_text("s" * 64 + "\n")
    (secrets / "RATCHET_PROXY__API_KEYS").write_text('["sk-file-one", "sk-file-two"]')
    (secrets / "RATCHET_REDIS_PASSWORD").write_text("from-file")
    (secrets / "RATCHET_PROXY__ADMIN_KEY").write_text("admin-from-file")
    # Kubernetes' own entries beside the files (..data links) are not settings.
    (secrets / "..data").mkdir()
    monkeypatch.setenv("RATCHET_SECRETS_DIR", str(secrets))
    monkeypatch.setenv("RATCHET_PROXY__ADMIN_KEY", "admin-from-env")
    s = load_settings()
    assert s.secret is not None and s.secret.get_secret_value() == "s" * 64
    assert [k.get_secret_value() for k in s.proxy.api_keys] == ["sk-file-one", "sk-file-two"]
    assert s.redis_password is not None and s.redis_password.get_secret_value() == "from-file"
    assert s.proxy.admin_key is not None
    assert s.proxy.admin_key.get_secret_value() == "admin-from-env"


def test_a_missing_secrets_folder_is_an_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A Secret that failed to mount must not start the service on defaults (no keys, no auth).
    monkeypatch.setenv("RATCHET_SECRETS_DIR", str(tmp_path / "not-mounted"))
    with pytest.raises(ConfigError, match=r"not-mounted.*RATCHET_SECRETS_DIR"):
        load_settings()


def test_an_empty_secret_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "RATCHET_REDIS_PASSWORD").write_text("\n")
    monkeypatch.setenv("RATCHET_SECRETS_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match=r"redis_password: .*blank"):
        load_settings()


def test_a_list_that_is_not_json_is_an_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Was a traceback: pydantic-settings fails before validation for a complex value.
    monkeypatch.setenv("RATCHET_PROXY__API_KEYS", "sk-one,sk-two")
    with pytest.raises(
        ConfigError, match=r"field \"proxy\".*is JSON, e.g. RATCHET_PROXY__API_KEYS="
    ):
        load_settings()
