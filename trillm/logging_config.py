"""How ``trillm serve`` configures Python logging, with vLLM's environment variables.

- default: one text line per record on stderr, at ``--log-level``; vLLM's
  ``VLLM_LOGGING_LEVEL``, when set, is the level of trillm's own loggers (``trillm.*``), as
  vLLM's is of its ``vllm`` loggers;
- ``--log-format json``: one JSON object per record (``JsonFormatter``), for log shippers;
- ``TRILLM_LOGGING_CONFIG_PATH`` (or vLLM's ``VLLM_LOGGING_CONFIG_PATH``): a JSON file for
  ``logging.config.dictConfig``, used as is (``trillm.logging_config.JsonFormatter`` can be
  named there as a formatter's ``"()"``);
- ``TRILLM_CONFIGURE_LOGGING=0`` (or ``VLLM_CONFIGURE_LOGGING=0``): trillm leaves logging alone
  (an embedding application configures it).
"""

from __future__ import annotations

import datetime
import json
import logging
import logging.config
from typing import Any

from trillm import envs

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# LogRecord attributes that are not a caller's ``extra=`` fields.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class LoggingConfigError(ValueError):
    """The logging environment variables name something unusable."""


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, the
    exception's traceback when there is one, and any ``extra=`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value if isinstance(value, str | int | float | bool) else repr(value)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(level: str, log_format: str = "text") -> None:
    """Root logging for ``trillm serve`` (see the module docstring for the precedence)."""
    if not envs.CONFIGURE_LOGGING.get():
        return
    path = envs.LOGGING_CONFIG_PATH.get()
    if path:
        logging.config.dictConfig(_load_dict_config(path))
        return
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper() if level != "trace" else "DEBUG")
    own_level = envs.LOGGING_LEVEL.get()
    if own_level is not None:
        logging.getLogger("trillm").setLevel(own_level)


def _load_dict_config(path: str) -> dict[str, Any]:
    where = "TRILLM_LOGGING_CONFIG_PATH / VLLM_LOGGING_CONFIG_PATH"
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as exc:
        raise LoggingConfigError(f"{where}: cannot read {path!r}: {exc.strerror}.") from None
    except json.JSONDecodeError as exc:
        raise LoggingConfigError(f"{where}: {path!r} is not valid JSON: {exc}.") from None
    if not isinstance(config, dict):
        raise LoggingConfigError(
            f"{where}: {path!r} must hold a logging.config.dictConfig object, "
            f"got {type(config).__name__}."
        )
    return config
