"""mlwe serve's settings: flags over MLWE_* over the config file over the defaults, and
errors that name the bad value and where it came from."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlwe.cli import app
from mlwe.runtime.settings import (
    ENV_CONFIG,
    SERVE_ENV_VARS,
    ServeSettings,
    SettingsError,
    env_name,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.upper().startswith("MLWE_"):
            monkeypatch.delenv(k)


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def test_the_defaults_are_those_of_make_run() -> None:
    s = ServeSettings.load()
    assert (s.host, s.port, s.backend, s.data_dir, s.database_url) == ("127.0.0.1", 8080, "sim", None, None)
    assert s.generator and s.agent and s.agent_mode == "autonomous" and s.cors_origins == ()


@pytest.mark.parametrize("suffix, text", [
    (".yaml", "port: 7001\nspeed: 2.5\ngenerator: false\n"),
    (".toml", "port = 7001\nspeed = 2.5\ngenerator = false\n"),
    (".json", '{"port": 7001, "speed": 2.5, "generator": false}'),
])
def test_a_config_file_in_each_format(tmp_path: Path, suffix: str, text: str) -> None:
    s = ServeSettings.load(config=write(tmp_path, "serve" + suffix, text))
    assert (s.port, s.speed, s.generator) == (7001, 2.5, False)


def test_flags_beat_the_environment_which_beats_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = write(tmp_path, "serve.yaml", "port: 7001\nhost: 10.0.0.1\nseed: 3\n")
    monkeypatch.setenv(ENV_CONFIG, str(cfg))  # the file named by the environment
    monkeypatch.setenv("MLWE_PORT", "7002")
    monkeypatch.setenv("MLWE_HOST", "10.0.0.2")
    s = ServeSettings.load(port=7003, host=None)  # None: the flag was not given
    assert (s.port, s.host, s.seed) == (7003, "10.0.0.2", 3)


def test_environment_values_are_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLWE_CORS_ORIGINS", "https://a.example, https://b.example")
    monkeypatch.setenv("MLWE_AGENT", "false")
    monkeypatch.setenv("MLWE_DATA_DIR", "/var/lib/mlwe")
    monkeypatch.setenv("MLWE_DATABASE_URL", "postgresql://u:secret@db/mlwe")
    s = ServeSettings.load()
    assert s.cors_origins == ("https://a.example", "https://b.example")
    assert s.agent is False and s.data_dir == Path("/var/lib/mlwe")
    assert s.database_url_value() == "postgresql://u:secret@db/mlwe"
    # the password is in neither the repr nor the description
    assert "secret" not in repr(s) and "secret" not in json.dumps(s.describe())
    assert s.describe()["database_url"] == "***"


@pytest.mark.parametrize("env, expected", [
    ({"MLWE_PORT": "abc"}, "$MLWE_PORT: Input should be a valid integer"),
    ({"MLWE_PORT": "70000"}, "$MLWE_PORT: Input should be less than or equal to 65535 (got '70000')"),
    ({"MLWE_BACKEND": "k8s"}, "$MLWE_BACKEND: Input should be 'sim', 'local', 'ray' or 'slurm'"),
    ({"MLWE_SPEED": "0"}, "$MLWE_SPEED: Input should be greater than or equal to 0.01"),
    ({"MLWE_BUS": "redis://x"}, "$MLWE_BUS: Value error, use nats://HOST:PORT"),
    ({"MLWE_GENERATOR": "maybe"}, "$MLWE_GENERATOR: Input should be a valid boolean"),
])
def test_a_bad_environment_value_is_named(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: str
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SettingsError) as e:
        ServeSettings.load()
    assert expected in str(e.value)


def test_a_bad_config_file_is_named_key_by_key(tmp_path: Path) -> None:
    cfg = write(tmp_path, "serve.yaml", "port: 0\nbogus: 1\nagent_mode: yolo\n")
    with pytest.raises(SettingsError) as e:
        ServeSettings.load(config=cfg)
    msg = str(e.value)
    assert f"'port' in config file {cfg}: Input should be greater than or equal to 1" in msg
    assert f"'bogus' in config file {cfg}: not a setting" in msg
    assert f"'agent_mode' in config file {cfg}: Input should be 'autonomous'" in msg


@pytest.mark.parametrize("name, text, expected", [
    ("serve.ini", "port=1", "unknown format '.ini'"),
    ("serve.yaml", "- a\n- b\n", "expected a mapping of setting names to values, got list"),
    ("serve.toml", "port = ", "not valid TOML"),
    ("serve.json", "{", "not valid JSON"),
])
def test_an_unreadable_config_file_says_why(tmp_path: Path, name: str, text: str, expected: str) -> None:
    with pytest.raises(SettingsError, match="config file .*" + expected.replace("(", r"\(").replace(")", r"\)")):
        ServeSettings.load(config=write(tmp_path, name, text))


def test_a_missing_config_file_is_an_error_not_the_defaults(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="not found"):
        ServeSettings.load(config=tmp_path / "nope.yaml")


def test_a_bad_flag_value_names_the_flag() -> None:
    with pytest.raises(SettingsError, match="--agent-mode: Input should be"):
        ServeSettings.load(agent_mode="yolo")
    with pytest.raises(SettingsError, match="unknown setting"):
        ServeSettings.load(colour="blue")


def test_every_setting_has_its_env_var() -> None:
    assert env_name("data_dir") == "MLWE_DATA_DIR"
    assert set(SERVE_ENV_VARS) == {env_name(f) for f in ServeSettings.model_fields}
    assert "MLWE_CONFIG" in SERVE_ENV_VARS


def test_serve_show_config_and_a_bad_value_on_the_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = CliRunner()
    monkeypatch.setenv("MLWE_PORT", "9001")
    cfg = write(tmp_path, "serve.toml", 'agent_mode = "observe"\n')
    r = runner.invoke(app, ["serve", "--config", str(cfg), "--no-generator", "--show-config"])
    assert r.exit_code == 0, r.output
    shown = json.loads(r.stdout)
    assert (shown["port"], shown["agent_mode"], shown["generator"]) == (9001, "observe", False)
    monkeypatch.setenv("MLWE_PORT", "x")
    bad = runner.invoke(app, ["serve", "--show-config"])
    assert bad.exit_code == 2
    assert "$MLWE_PORT: Input should be a valid integer" in bad.output


def test_slurm_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLWE_BACKEND", "slurm")
    monkeypatch.setenv("MLWE_SLURM_PARTITION", "gpu")
    monkeypatch.setenv("MLWE_SLURM_RUN_DIR", "/shared/mlwe")
    s = ServeSettings.load()
    assert (s.backend, s.slurm_partition, str(s.slurm_run_dir), s.slurm_prefix) == (
        "slurm", "gpu", "/shared/mlwe", "mlwe")
    monkeypatch.setenv("MLWE_SLURM_PREFIX", "has space")
    with pytest.raises(SettingsError, match=r"\$MLWE_SLURM_PREFIX: String should match"):
        ServeSettings.load()
