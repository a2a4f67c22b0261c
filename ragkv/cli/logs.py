"""Log setup for `ragkv` commands: plain text, or one JSON object per line (`--log-format
json`, for log collectors). uvicorn's loggers propagate to the same handler."""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone

LOG_FORMATS = ("text", "json")
_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Attributes every LogRecord has; anything else on a record came in through `extra=`.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """{"time", "level", "logger", "message", ...the record's extra fields, "exception"}."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({key: value for key, value in vars(record).items() if key not in _STANDARD})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def configure_logging(level: str, log_format: str = "text", *, access_log: bool = False) -> None:
    """Root logger at `level` writing to stderr in `log_format`; with `access_log` the
    `ragkv.access` logger writes its per-request lines whatever `level` is."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(_TEXT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers.clear()  # uvicorn's own handlers would print a second, unformatted copy
        logging.getLogger(name).propagate = True
    logging.getLogger("ragkv.access").setLevel(logging.INFO if access_log else logging.WARNING)
