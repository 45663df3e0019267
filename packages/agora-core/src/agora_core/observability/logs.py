"""structlog setup shared by every Agora process.

Humans at a terminal get the console renderer; anything else (log files, CI, a swarm's run
directory) gets one JSON object per line. ``AGORA_LOG_FORMAT`` / ``--log-format`` switch it.
"""

from __future__ import annotations

import logging
import sys
from typing import IO, Literal

import structlog

LogFormat = Literal["auto", "console", "json"]
LOG_FORMATS = ("auto", "console", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")


def configure_logging(*, fmt: LogFormat = "auto", level: str = "info", stream: IO[str] | None = None) -> None:
    """Configure structlog process-wide. Safe to call again (e.g. after parsing CLI flags)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    if level.lower() not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {LOG_LEVELS}, got {level!r}")
    stream = stream or sys.stderr
    if fmt == "auto":
        fmt = "console" if getattr(stream, "isatty", lambda: False)() else "json"
    processors: list = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if fmt == "json":
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=stream.isatty()))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )


def get_logger(component: str, **context) -> structlog.typing.FilteringBoundLogger:
    """A logger bound to a component name (``rpc.server``) and any extra context."""
    # Initial values keep the proxy lazy: a module-level logger follows later configuration.
    return structlog.get_logger(component=component, **context)
