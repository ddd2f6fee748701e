"""One typed settings object for every Ratchet service.

Values come, highest priority first, from: keyword arguments, ``RATCHET_*`` environment
variables (nested sections with ``__``, e.g. ``RATCHET_PROXY__PORT=9000``), then ``ratchet.yaml``
(``$RATCHET_CONFIG``, else ``./ratchet.yaml``, or ``--config PATH``). Each service reads the part
it needs. Validation happens at start; :func:`load_settings` turns pydantic's errors into one
message per bad setting that names it and says how to fix it.

One module per section; this package re-exports every name, so ``from ratchet.settings import X``
is the one import. `python -m ratchet.settings.generate` writes the chart's values schema and the
configuration reference from these models.
"""

from ratchet.settings.alias import (
    AliasConfig,
    FeedbackConfig,
    GateConfig,
    LearningConfig,
    RewardConfig,
    SamplingConfig,
)
from ratchet.settings.base import (
    DEFAULT_BASE_MODEL,
    DEFAULT_RUBRIC,
    HOST_PATTERN,
    NAME_PATTERN,
    NAME_RULE,
    ConfigError,
    _Section,
    default_home,
    is_ip_address,
    is_loopback,
)
from ratchet.settings.canary import CanaryConfig
from ratchet.settings.console import ConsoleSettings
from ratchet.settings.judge import JudgeSettings
from ratchet.settings.kafka import KafkaSettings
from ratchet.settings.learner import (
    MOVED_KEYS,
    LearnerSettings,
    LoraSettings,
    LossMode,
    LossSettings,
    ScaleRewards,
)
from ratchet.settings.proxy import ProxySettings, redaction_regex
from ratchet.settings.proxy_bounds import RateLimitSettings
from ratchet.settings.root import (
    DEFAULT_REDIS_URL,
    SECRETS_DIR_VARIABLE,
    RatchetSettings,
    config_path,
    load_settings,
    settings_error_hint,
)
from ratchet.settings.served_check import ServedCheckSettings

__all__ = [
    "DEFAULT_BASE_MODEL",
    "DEFAULT_REDIS_URL",
    "DEFAULT_RUBRIC",
    "HOST_PATTERN",
    "MOVED_KEYS",
    "NAME_PATTERN",
    "NAME_RULE",
    "SECRETS_DIR_VARIABLE",
    "AliasConfig",
    "CanaryConfig",
    "ConfigError",
    "ConsoleSettings",
    "FeedbackConfig",
    "GateConfig",
    "JudgeSettings",
    "KafkaSettings",
    "LearnerSettings",
    "LearningConfig",
    "LoraSettings",
    "LossMode",
    "LossSettings",
    "ProxySettings",
    "RatchetSettings",
    "RateLimitSettings",
    "RewardConfig",
    "SamplingConfig",
    "ScaleRewards",
    "ServedCheckSettings",
    "_Section",
    "config_path",
    "default_home",
    "is_ip_address",
    "is_loopback",
    "load_settings",
    "redaction_regex",
    "settings_error_hint",
]
