"""The process's log: how each line looks and which loggers speak.

Two formats: `text` for people (`TIME LEVEL LOGGER: MESSAGE`) and `json` for log shippers, one
JSON object per line: `time` (RFC 3339, UTC), `level`, `logger`, `message`, the record's own
`fields` (a dict passed as `extra={"fields": ...}`, such as the access log's) as more keys, and
`exception` when there is one.

The server's life (serving, ready, stopping, stopped) and the access log are shown at any
`log.level`: they are few lines, and an operator needs them; `log.level` sets every other
logger. Prompts, completions, tokens and keys are never logged (STYLE.md, habit 15).
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, Literal, get_args

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[str, ...] = get_args(LogFormat)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The loggers whose INFO lines are shown whatever log.level says: the `inferno` command's own
# progress, the server's life, the access log.
ALWAYS_INFO = ("inferno", "appliance.server", "appliance.boot.startup", "appliance.api.access_log")
FIELDS = "fields"


class JsonFormatter(logging.Formatter):
    """Each record as one line of JSON (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in getattr(record, FIELDS, {}).items():
            entry.setdefault(key, value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure_logging(level: str, log_format: LogFormat) -> None:
    """Send every log line (Python warnings too) to stderr in `log_format`, at `level` (see the
    module docstring for the loggers shown at any level). Callable again to change either."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    logging.basicConfig(level=level, handlers=[handler], force=True)
    logging.captureWarnings(True)
    info = min(logging.getLevelNamesMapping()[level], logging.INFO)
    for name in ALWAYS_INFO:
        logging.getLogger(name).setLevel(info)
