"""Config: defaults, environment parsing, overrides, validation, README table;
and the logger it configures."""

from __future__ import annotations

import dataclasses
import io
import logging
import re
import warnings
from pathlib import Path

import pytest

from ubnext._environment.config import Config
from ubnext._environment.log import get_logger, log_once

README = Path(__file__).resolve().parents[1] / "README.md"

DEFAULTS = {
    "pool_mb": 1024,
    "staging_mb": 128,
    "lamport_max_kb": 1024,
    "lamport_twoshot_max_kb": 16384,
    "algorithm": "auto",
    "timeout_s": 600.0,
    "nvls": "auto",
    "max_blocks": 0,
    "log_level": "WARNING",
    "debug": False,
    "deterministic": False,
    "tune_file": "",
    "table_mode": "graph",
    "quantized": "off",
    "pdl": True,
}


def test_defaults():
    assert dataclasses.asdict(Config()) == DEFAULTS
    assert Config.from_env({}) == Config()


def test_every_field_has_metadata():
    envs = [f.metadata["env"] for f in dataclasses.fields(Config)]
    assert len(envs) == len(set(envs)) == len(DEFAULTS)
    assert all(e.startswith("UBNEXT_") for e in envs)
    assert all(f.metadata["doc"] for f in dataclasses.fields(Config))


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().pool_mb = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("var", "text", "field", "value"),
    [
        ("UBNEXT_POOL_MB", " 512 ", "pool_mb", 512),
        ("UBNEXT_STAGING_MB", "64", "staging_mb", 64),
        ("UBNEXT_LAMPORT_MAX_KB", "256", "lamport_max_kb", 256),
        ("UBNEXT_LAMPORT_TWOSHOT_MAX_KB", "4096", "lamport_twoshot_max_kb", 4096),
        ("UBNEXT_ALGO", "TwoShot", "algorithm", "twoshot"),
        ("UBNEXT_ALGO", "nccl", "algorithm", "nccl"),
        ("UBNEXT_TIMEOUT_S", "2.5", "timeout_s", 2.5),
        ("UBNEXT_TIMEOUT_S", "1e-3", "timeout_s", 0.001),
        ("UBNEXT_NVLS", "0", "nvls", "0"),
        ("UBNEXT_NVLS", "AUTO", "nvls", "auto"),
        ("UBNEXT_MAX_BLOCKS", "0", "max_blocks", 0),
        ("UBNEXT_MAX_BLOCKS", "132", "max_blocks", 132),
        ("UBNEXT_LOG_LEVEL", "debug", "log_level", "DEBUG"),
        ("UBNEXT_TUNE_FILE", "/tmp/tune.json", "tune_file", "/tmp/tune.json"),
        ("UBNEXT_TABLE_MODE", " Dependent ", "table_mode", "dependent"),
    ],
)
def test_env_parsing(var, text, field, value):
    cfg = Config.from_env({var: text})
    assert getattr(cfg, field) == value
    assert dataclasses.replace(cfg, **{field: DEFAULTS[field]}) == Config()


@pytest.mark.parametrize(
    ("text", "value"),
    [(t, True) for t in ("1", "true", "YES", "On")] + [(t, False) for t in ("0", "false", "No", "off")],
)
def test_booleans(text, value):
    assert Config.from_env({"UBNEXT_DEBUG": text}).debug is value


def test_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("UBNEXT_POOL_MB", "256")
    assert Config.from_env().pool_mb == 256


def test_overrides_win_over_environment():
    env = {"UBNEXT_POOL_MB": "256", "UBNEXT_ALGO": "lamport", "UBNEXT_DEBUG": "1"}
    cfg = Config.from_env(env, pool_mb=2048, algorithm="TWOSHOT", debug=None, nvls=0)
    assert (cfg.pool_mb, cfg.algorithm, cfg.debug, cfg.nvls) == (2048, "twoshot", True, "0")


def test_unknown_override_is_type_error():
    with pytest.raises(TypeError, match="Config.from_env: unknown argument.*pool_size"):
        Config.from_env({}, pool_size=1)


@pytest.mark.parametrize(
    ("var", "text", "expected"),
    [
        ("UBNEXT_POOL_MB", "0", "an integer >= 1"),
        ("UBNEXT_POOL_MB", "1.5", "an integer >= 1"),
        ("UBNEXT_POOL_MB", "lots", "an integer >= 1"),
        ("UBNEXT_MAX_BLOCKS", "-1", "an integer >= 0"),
        ("UBNEXT_ALGO", "ring", "one of auto|lamport|lamport_twoshot|twoshot|nccl"),
        ("UBNEXT_TIMEOUT_S", "0", "a finite number > 0"),
        ("UBNEXT_TIMEOUT_S", "-3", "a finite number > 0"),
        ("UBNEXT_TIMEOUT_S", "inf", "a finite number > 0"),
        ("UBNEXT_TIMEOUT_S", "nan", "a finite number > 0"),
        ("UBNEXT_NVLS", "2", "one of auto|0|1"),
        ("UBNEXT_LOG_LEVEL", "loud", "one of DEBUG|INFO|WARNING|ERROR|CRITICAL"),
        ("UBNEXT_DEBUG", "maybe", "one of 1|true|yes|on|0|false|no|off"),
        ("UBNEXT_TABLE_MODE", "eager", "one of graph|dependent"),  # no tool measures eager entries
    ],
)
def test_invalid_environment_values(var, text, expected):
    with pytest.raises(ValueError) as info:
        Config.from_env({var: text})
    message = str(info.value)
    assert message.startswith(f"Config: invalid {var}={text!r}")
    assert expected in message


@pytest.mark.parametrize(
    ("field", "value"),
    [("pool_mb", True), ("pool_mb", 2.0), ("timeout_s", False), ("algorithm", 3), ("tune_file", 5),
     ("table_mode", "stream")],
)
def test_invalid_overrides_name_argument_and_variable(field, value):
    with pytest.raises(ValueError, match=rf"Config: invalid argument {field} \(UBNEXT_\w+\)="):
        Config.from_env({}, **{field: value})


def test_direct_construction_validates():
    with pytest.raises(ValueError, match="UBNEXT_ALGO"):
        Config(algorithm="fast")
    assert Config(pool_mb="64").pool_mb == 64


def test_unknown_variable_warns_once_with_suggestion():
    env = {"UBNEXT_POOL_MBS": "1", "UBNEXT_ZZZ": "1", "UBNEXT_ALGO": "auto", "OTHER": "x"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Config.from_env(env)
    assert len(caught) == 1
    warning = caught[0]
    assert warning.category is UserWarning
    text = str(warning.message)
    assert "UBNEXT_POOL_MBS (did you mean UBNEXT_POOL_MB?)" in text
    assert "UBNEXT_ZZZ" in text and "UBNEXT_ALGO," not in text.split("Known:")[0]


def test_known_variables_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Config.from_env({"UBNEXT_TIMEOUT_S": "5", "UBNEXT_DEBUG": "yes"})


def test_markdown_table_lists_every_field():
    lines = Config.markdown_table().splitlines()
    assert lines[0] == "| variable | default | meaning |"
    assert lines[1] == "|---|---|---|"
    rows = lines[2:]
    assert len(rows) == len(dataclasses.fields(Config))
    for row, f in zip(rows, dataclasses.fields(Config)):
        assert row.startswith(f"| `{f.metadata['env']}` | ")
    assert "| `UBNEXT_TIMEOUT_S` | `600` |" in rows[5]
    assert "| `UBNEXT_DEBUG` | `0` |" in rows[9]
    assert "| `UBNEXT_DETERMINISTIC` | `0` |" in rows[10]
    assert "| `UBNEXT_TUNE_FILE` | (empty) |" in rows[11]
    assert "| `UBNEXT_TABLE_MODE` | `graph` |" in rows[12]


def test_readme_table_matches_config():
    text = README.read_text()
    match = re.search(
        r"<!-- config-table:start -->\n(.*?)<!-- config-table:end -->", text, re.DOTALL
    )
    assert match, "README.md lacks the config-table markers"
    assert match.group(1).strip() == Config.markdown_table().strip(), (
        "README configuration table is stale; regenerate it from "
        "Config.markdown_table()"
    )


def test_logger_prefix_level_and_log_once():
    logger = get_logger()
    (handler,) = [h for h in logger.handlers if type(h) is logging.StreamHandler]  # ubnext's own
    level, stream = logger.level, io.StringIO()
    old_stream = handler.setStream(stream)
    try:
        assert get_logger(Config.from_env({"UBNEXT_LOG_LEVEL": "info"}), rank=3) is logger
        assert logger.level == logging.INFO
        assert log_once("test:once", "op: first", logging.INFO) is True
        assert log_once("test:once", "op: again", logging.INFO) is False
        logger.debug("op: hidden")
    finally:
        handler.setStream(old_stream)
        logger.setLevel(level)
    assert stream.getvalue() == "[ubnext rank 3] INFO: op: first\n"
