"""The whole settings object, where its values come from, and :func:`load_settings`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import (
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    NestedSecretsSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    YamlConfigSettingsSource,
)

from ratchet.settings.alias import AliasConfig
from ratchet.settings.base import (
    NAME_PATTERN,
    NAME_RULE,
    ConfigError,
    default_home,
    is_loopback,
)
from ratchet.settings.console import ConsoleSettings
from ratchet.settings.judge import JudgeSettings
from ratchet.settings.kafka import KafkaSettings
from ratchet.settings.learner import LearnerSettings
from ratchet.settings.proxy import ProxySettings

DEFAULT_REDIS_URL = "redis://127.0.0.1:6399/0"
# A folder of secret files, one per setting, named as its environment variable
# (RATCHET_PROXY__API_KEYS, ...): a Kubernetes Secret mounted as a volume, so that secrets are
# not in the environment, where every process the service starts and every crash dump sees them.
SECRETS_DIR_VARIABLE = "RATCHET_SECRETS_DIR"


class RatchetSettings(BaseSettings):
    """Settings for every Ratchet service, validated once at start."""

    model_config = SettingsConfigDict(
        env_prefix="RATCHET_",
        env_nested_delimiter="__",
        extra="forbid",
    )

    kafka_bootstrap_servers: str = Field(
        default="127.0.0.1:9092",
        description="Kafka bootstrap servers, host:port[,host:port...].",
    )
    redis_url: str = Field(
        default=DEFAULT_REDIS_URL,
        description=(
            "Left at this default it names the embedded stack's Redis, which requires a password "
            "derived from the secret (ratchet.secrets.redis_connection_url); a URL you set is "
            "used as given."
        ),
    )
    redis_password: SecretStr | None = Field(
        default=None,
        description=(
            "Redis's password (with a username in redis_url, that user's), kept out of the URL so "
            "it can come from a secret file or RATCHET_REDIS_PASSWORD; it replaces one in "
            "redis_url."
        ),
    )
    vllm_url: str = Field(
        default="http://127.0.0.1:8401",
        description="The vLLM server the services call (OpenAI-compatible base URL, without /v1).",
    )
    vllm_endpoints: list[str] = Field(
        default=[],
        description=(
            "vLLM replicas the proxy balances across, request by request (ratchet/fleet.py: a "
            "served name sticks to the replicas that hold its adapter, and spreads when it is "
            "hot; a replica that fails its health check is left out until it passes). Empty: "
            "vllm_url alone."
        ),
    )
    secret: SecretStr | None = Field(
        default=None,
        description=(
            "Keys API-key hashes, the held-out split and canary stickiness (ratchet/secrets.py). "
            "Every replica of every service must share it; unset, the services of one machine "
            "share a random one kept in state_dir."
        ),
    )
    vllm_api_key: SecretStr | None = Field(
        default=None,
        description="What vLLM requires as its --api-key; unset, derived from the secret.",
    )
    home: Path = Field(
        default_factory=default_home,
        description=(
            "Where the embedded stack keeps its state, logs, model cache and adapter store; "
            "$RATCHET_HOME, else ~/.cache/ratchet."
        ),
    )
    store_dir: Path | None = Field(
        default=None,
        description=(
            "Defaults derive from `home` (see _derive_paths) so one variable moves everything."
        ),
    )
    state_dir: Path | None = Field(
        default=None,
        description=(
            "Where a service keeps its local state (the proxy's spool, the shared secret); "
            "unset: home/state."
        ),
    )
    kafka: KafkaSettings = KafkaSettings()
    proxy: ProxySettings = ProxySettings()
    judge: JudgeSettings = JudgeSettings()
    learner: LearnerSettings = LearnerSettings()
    console: ConsoleSettings = ConsoleSettings()
    aliases: dict[str, AliasConfig] = Field(
        default={"support": AliasConfig()},
        description=(
            "The aliases the proxy serves and the learner trains, by name: each one's reward, "
            "learning, sampling, gate, canary and ratings settings."
        ),
    )

    @field_validator("secret", "vllm_api_key", "redis_password")
    @classmethod
    def _secret_not_blank(cls, value: SecretStr | None) -> SecretStr | None:
        # Blank (an unset environment variable) would be a secret anyone knows, and vLLM given
        # a blank key requires none at all.
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("is blank; remove it or set it to a long random value")
        return value

    @field_validator("vllm_api_key")
    @classmethod
    def _vllm_key_is_a_token(cls, value: SecretStr | None) -> SecretStr | None:
        # It travels in an "Authorization: Bearer" header: a space or line break cannot.
        if value is not None and not all(33 <= ord(c) <= 126 for c in value.get_secret_value()):
            raise ValueError("must be printable ASCII without spaces or line breaks")
        return value

    @field_validator("aliases")
    @classmethod
    def _alias_names(cls, aliases: dict[str, AliasConfig]) -> dict[str, AliasConfig]:
        for name in aliases:
            if not NAME_PATTERN.match(name):
                raise ValueError(f"alias {name!r} is not a valid name: {NAME_RULE}")
        return aliases

    @model_validator(mode="after")
    def _derive_paths(self) -> RatchetSettings:
        if self.store_dir is None:
            self.store_dir = self.home / "adapters"
        if self.state_dir is None:
            self.state_dir = self.home / "state"
        return self

    @model_validator(mode="after")
    def _heldout_pool_fits_the_gate(self) -> RatchetSettings:
        # The learner waits for gate.min_pairs held-out prompts before a round: a smaller pool
        # would make it wait forever.
        for name, alias in self.aliases.items():
            if alias.learning.enabled and alias.gate.min_pairs > self.learner.heldout_pool:
                raise ValueError(
                    f"aliases.{name}.gate.min_pairs ({alias.gate.min_pairs}) is larger than "
                    f"learner.heldout_pool ({self.learner.heldout_pool}): the gate could never "
                    "get enough held-out prompts. Raise learner.heldout_pool or lower min_pairs"
                )
        return self

    def check_proxy_exposure(self) -> None:
        """Refuse to serve the proxy without keys anywhere but loopback.

        Checked when the proxy starts, not at load: the judge and learner read the same file and
        neither need nor should be given the client keys.
        """
        if not self.proxy.api_keys and not is_loopback(self.proxy.host):
            raise ConfigError(
                f"invalid Ratchet settings:\n  proxy.api_keys is empty while proxy.host is "
                f"{self.proxy.host!r}: running without auth is only allowed on a loopback "
                "address. Set RATCHET_PROXY__API_KEYS (a JSON list) or proxy.api_keys in "
                "ratchet.yaml, or bind to 127.0.0.1"
            )

    def check_console_exposure(self) -> None:
        """Refuse to serve the console anywhere but loopback without the admin key: its pages
        show what users asked and what the model answered, and its actions change routing."""
        if self.proxy.admin_key is None and not is_loopback(self.console.host):
            raise ConfigError(
                f"invalid Ratchet settings:\n  proxy.admin_key is not set while console.host is "
                f"{self.console.host!r}: the console is only served without a key on a loopback "
                "address. Set RATCHET_PROXY__ADMIN_KEY or proxy.admin_key in ratchet.yaml, or "
                "bind console.host to 127.0.0.1"
            )

    @property
    def console_needs_login(self) -> bool:
        """Reading pages needs the admin key too when the console is not on loopback."""
        return not is_loopback(self.console.host)

    @property
    def spool_dir(self) -> Path:
        assert self.state_dir is not None
        return self.state_dir / "spool"

    @property
    def auth_enabled(self) -> bool:
        return bool(self.proxy.api_keys)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        yaml_path = _config_file or config_path()
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        secrets_dir = os.environ.get(SECRETS_DIR_VARIABLE)
        if secrets_dir:
            # A folder named but missing is a broken mount: an error, not the defaults.
            sources.append(
                NestedSecretsSettingsSource(
                    file_secret_settings, secrets_dir=secrets_dir, secrets_dir_missing="error"
                )
            )
        if yaml_path.is_file():
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=yaml_path))
        return tuple(sources)


def config_path() -> Path:
    return Path(os.environ.get("RATCHET_CONFIG", "ratchet.yaml"))


# The file load_settings() was asked to read; a module global rather than an environment
# variable, so loading settings has no effect on the process environment.
_config_file: Path | None = None


def settings_error_hint(exc: SettingsError) -> str:
    """pydantic-settings' message for a value a source could not read, with the fix."""
    message = str(exc)
    if "does not exist" in message or "secrets_dir" in message:
        return f"{message}: {SECRETS_DIR_VARIABLE} names the folder of secret files"
    return (
        f"{message}: a list or mapping in the environment or a secret file is JSON, "
        """e.g. RATCHET_PROXY__API_KEYS='["sk-one", "sk-two"]'"""
    )


def load_settings(path: Path | str | None = None, **overrides: Any) -> RatchetSettings:
    """Read and validate settings; raise ConfigError naming every bad setting and its fix."""
    global _config_file
    if path is not None and not Path(path).is_file():
        raise ConfigError(f"config file {path} (from --config) does not exist")
    if path is None and "RATCHET_CONFIG" in os.environ and not config_path().is_file():
        # An explicit path that names no file is a typo, not a request for the defaults.
        raise ConfigError(f"config file {config_path()} (from RATCHET_CONFIG) does not exist")
    _config_file = Path(path) if path is not None else None
    source = _config_file or config_path()
    try:
        return RatchetSettings(**overrides)
    except SettingsError as exc:  # raised by a source, before validation
        raise ConfigError(f"invalid Ratchet settings:\n  {settings_error_hint(exc)}") from None
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            if not err["loc"]:  # a rule across several settings: its message names them
                lines.append(f"  {err['msg']}")
                continue
            where = ".".join(str(part) for part in err["loc"])
            env = "RATCHET_" + "__".join(str(p).upper() for p in err["loc"] if isinstance(p, str))
            lines.append(f"  {where}: {err['msg']} (set it in {source} or {env})")
        raise ConfigError("invalid Ratchet settings:\n" + "\n".join(lines)) from None
    finally:
        # Only this call reads that file: a later RatchetSettings() must not inherit it.
        _config_file = None
