"""The log's two formats: JSON lines a log shipper parses, and which loggers speak at any
level."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator

import pytest

from appliance.logs import JsonFormatter, configure_logging


@pytest.fixture
def restored_logging() -> Iterator[None]:
    """configure_logging changes the process's root logger: put pytest's back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)


def _record(message: str, *args: object, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("appliance.x", logging.ERROR, __file__, 1, message, args, None)
    record.__dict__.update(extra)
    return record


def test_json_line_has_time_level_logger_message_and_the_records_fields() -> None:
    record = _record("refused %s", "a\nrequest", fields={"status": 401, "route": "/v1/models"})
    line = JsonFormatter().format(record)
    assert "\n" not in line
    parsed = json.loads(line)
    assert parsed["time"].endswith("Z") and "T" in parsed["time"]
    assert {key: parsed[key] for key in ("level", "logger", "message", "status", "route")} == {
        "level": "ERROR",
        "logger": "appliance.x",
        "message": "refused a\nrequest",
        "status": 401,
        "route": "/v1/models",
    }


def test_json_line_of_an_exception_carries_its_traceback_in_one_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = _record("failed", exc_info=sys.exc_info())
    line = JsonFormatter().format(record)
    assert "\n" not in line
    assert "ValueError: boom" in json.loads(line)["exception"]


def test_fields_cannot_overwrite_the_standard_keys() -> None:
    line = JsonFormatter().format(_record("real", fields={"message": "forged", "level": "INFO"}))
    assert (json.loads(line)["message"], json.loads(line)["level"]) == ("real", "ERROR")


@pytest.mark.usefixtures("restored_logging")
def test_lifecycle_and_access_lines_show_at_warning_and_others_do_not(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure_logging("WARNING", "json")
    logging.getLogger("appliance.boot.startup").info("ready")
    logging.getLogger("appliance.api.access_log").info("GET /health 200")
    logging.getLogger("appliance.engine").info("engine detail")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [line["message"] for line in lines] == ["ready", "GET /health 200"]
