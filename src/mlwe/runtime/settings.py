"""The server's configuration: ``MLWE_*`` environment variables and a config file.

One place says what ``mlwe serve`` can be told and where each value may come
from. Highest precedence first:

1. command-line flags (``mlwe serve --port 9000``), passed as keyword arguments;
2. environment variables, the field name upper-cased with the ``MLWE_`` prefix
   (``MLWE_PORT=9000``, ``MLWE_DATA_DIR=/var/lib/mlwe``, ``MLWE_GENERATOR=false``,
   ``MLWE_CORS_ORIGINS=https://a.example,https://b.example``);
3. a config file, named by ``--config FILE`` or ``$MLWE_CONFIG``: YAML
   (``.yaml``/``.yml``), TOML (``.toml``) or JSON (``.json``), a mapping of the
   same field names (``port: 9000``); an unknown key is an error, not ignored;
4. the defaults below.

Values are validated (a port outside 1..65535, an unknown backend, a negative
speed): :meth:`ServeSettings.load` raises :class:`SettingsError` whose message
names each bad value with the environment variable or file key it came from.
Secrets (``database_url`` may carry a password) are ``SecretStr``: they never
appear in a repr or in :meth:`ServeSettings.describe`.

Other ``MLWE_*`` variables belong to other parts and are not settings here:
the client's ``MLWE_URL``/``MLWE_TOKEN`` (:mod:`mlwe.client`), what the local
daemon sets for a workload (``MLWE_WORKLOAD_ID``, ``MLWE_CHECKPOINT_DIR``, ...:
:mod:`mlwe.workload`), the LLM reasoners' ``MLWE_OPENAI_*``/``MLWE_ADK_*``,
``MLWE_TRACES_DIR`` and ``MLWE_SQLITE_SYNCHRONOUS``. :data:`ENV_PREFIX`,
:func:`env_name` and :class:`ConfigFileSource` are the pieces another settings
class (a client's, say) builds on, so every part reads its file and its
environment the same way.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

#: Every mlwe setting's environment variable starts with this.
ENV_PREFIX = "MLWE_"
#: The environment variable naming the config file (the ``config`` field).
ENV_CONFIG = f"{ENV_PREFIX}CONFIG"

Backend = Literal["sim", "local", "ray", "slurm"]
AgentMode = Literal["autonomous", "approve", "observe"]
LogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]


def env_name(field: str) -> str:
    """The environment variable of setting ``field`` (``data_dir`` -> ``MLWE_DATA_DIR``)."""
    return f"{ENV_PREFIX}{field.upper()}"


class SettingsError(ValueError):
    """The configuration is not valid; the message names every bad value and its source."""


def read_config_file(path: Path) -> dict[str, Any]:
    """The mapping a config file holds (YAML, TOML or JSON by its suffix)."""
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml", ".json"):
        raise SettingsError(f"config file {path}: unknown format {suffix or '(no suffix)'!r};"
                            " use .yaml, .yml, .toml or .json")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SettingsError(f"config file {path} not found (set by --config or"
                            f" ${ENV_CONFIG})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"config file {path}: cannot read it: {exc}") from None
    try:
        if suffix == ".toml":
            data: Any = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, yaml.YAMLError) as exc:
        raise SettingsError(f"config file {path}: not valid {suffix[1:].upper()}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise SettingsError(f"config file {path}: expected a mapping of setting names to"
                            f" values, got {type(data).__name__}")
    return data


class ConfigFileSource(PydanticBaseSettingsSource):
    """A settings source reading the file named by the ``config`` init argument or
    ``$MLWE_CONFIG`` (below the environment, above the defaults)."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path | None) -> None:
        super().__init__(settings_cls)
        self.path = path
        self.data = read_config_file(path) if path is not None else {}

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self.data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        # every key, known or not: an unknown one fails validation (extra="forbid")
        return {k: v for k, v in self.data.items() if k != "config"}


class MlweSettings(BaseSettings):
    """Base of mlwe's settings classes: ``MLWE_*`` environment, a config file, validation
    errors that name their source. Subclasses declare fields."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="forbid",  # an unknown key in a config file is a typo, not a no-op
        case_sensitive=False,
        validate_default=True,
    )

    config: Path | None = Field(
        default=None, description="config file (YAML, TOML or JSON) read below the environment"
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        init_kwargs: dict[str, Any] = getattr(init_settings, "init_kwargs", {})
        named = init_kwargs.get("config") or os.environ.get(ENV_CONFIG) or None
        path = Path(named) if named is not None else None
        return (init_settings, env_settings, ConfigFileSource(settings_cls, path))

    @classmethod
    def load(cls, **overrides: Any) -> MlweSettings:
        """The settings from ``overrides`` (flags; None means not given), the environment
        and the config file; raises :class:`SettingsError` naming what is wrong."""
        given = {k: v for k, v in overrides.items() if v is not None}
        unknown = sorted(set(given) - set(cls.model_fields))
        if unknown:
            raise SettingsError(f"unknown setting(s): {', '.join(unknown)}")
        try:
            return cls(**given)
        except ValidationError as exc:
            raise SettingsError(cls._explain(exc, given)) from None

    @classmethod
    def _explain(cls, exc: ValidationError, given: dict[str, Any]) -> str:
        config = given.get("config") or os.environ.get(ENV_CONFIG)
        lines = []
        for e in exc.errors():
            name = str(e["loc"][0]) if e["loc"] else "?"
            if name in given:
                where = f"--{name.replace('_', '-')}"
            elif name not in cls.model_fields:
                where = f"'{name}' in config file {config}"
                lines.append(f"{where}: not a setting (known: {', '.join(cls.model_fields)})")
                continue
            elif any(k.upper() == env_name(name) for k in os.environ):
                where = f"${env_name(name)}"
            elif config:
                where = f"'{name}' in config file {config}"
            else:
                where = name
            value = "" if "input" not in e else f" (got {e['input']!r})"
            lines.append(f"{where}: {e['msg']}{value}")
        return "invalid configuration:\n  " + "\n  ".join(lines)

    def describe(self) -> dict[str, Any]:
        """The effective settings as plain JSON-able values, secrets shown as ``***``."""
        out: dict[str, Any] = {}
        for name in type(self).model_fields:
            v = getattr(self, name)
            if isinstance(v, SecretStr):
                v = "***"
            elif isinstance(v, Path):
                v = str(v)
            elif isinstance(v, tuple):
                v = list(v)
            out[name] = v
        return out


class ServeSettings(MlweSettings):
    """What ``mlwe serve`` runs: where it listens, where it keeps its data, which
    backend and bus it uses, and what runs inside it."""

    host: str = Field(default="127.0.0.1", min_length=1,
                      description="address to listen on (0.0.0.0 in a container)")
    port: int = Field(default=8080, ge=1, le=65535, description="HTTP port")
    log_level: LogLevel = Field(default="info", description="server log level")
    data_dir: Path | None = Field(
        default=None, description="data directory of the default SQLite store (./.mlwe)")
    database_url: SecretStr | None = Field(
        default=None, description="SQLAlchemy URL of the store (default: SQLite in data_dir)")
    backend: Backend = Field(default="sim", description="sim, local, ray or slurm")
    cluster: Path | None = Field(default=None, description="cluster spec file")
    ray_address: str | None = Field(default=None, description="Ray cluster HOST:PORT or 'local'")
    slurm_partition: str | None = Field(
        default=None, min_length=1,
        description="--backend slurm: the partition whose nodes mlwe schedules (default: all)")
    slurm_run_dir: Path | None = Field(
        default=None, description="--backend slurm: a directory shared with the nodes (job"
        " scripts, reports, checkpoints; default <data_dir>/slurm)")
    slurm_prefix: str = Field(
        default="mlwe", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
        description="--backend slurm: marks this engine's jobs (adopted after a restart)")
    bus: str | None = Field(default=None, description="event bus URL (nats://HOST:PORT)")
    generator: bool = Field(default=True, description="run the background workload generator")
    agent: bool = Field(default=True, description="run the agent loop")
    agent_mode: AgentMode = Field(default="autonomous", description="autonomous, approve or observe")
    speed: float = Field(default=1.0, ge=0.01, le=1000, description="engine clock speed")
    seed: int = Field(default=0, ge=0, description="seed of the simulator and the generator")
    cors_origins: Annotated[tuple[str, ...], NoDecode] = Field(
        default=(), description="allowed browser origins (comma-separated in the environment)")

    @field_validator("cors_origins", mode="before")
    @classmethod
    def _split_origins(cls, v: Any) -> Any:
        if isinstance(v, str):
            return tuple(o.strip() for o in v.split(",") if o.strip())
        return v

    @field_validator("bus")
    @classmethod
    def _check_bus(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("nats://"):
            raise ValueError("use nats://HOST:PORT")
        return v

    @classmethod
    def load(cls, **overrides: Any) -> ServeSettings:
        s = super().load(**overrides)
        assert isinstance(s, ServeSettings)
        return s

    def database_url_value(self) -> str | None:
        return self.database_url.get_secret_value() if self.database_url is not None else None


#: Every environment variable ``mlwe serve`` reads through :class:`ServeSettings`.
SERVE_ENV_VARS: tuple[str, ...] = tuple(env_name(f) for f in ServeSettings.model_fields)
