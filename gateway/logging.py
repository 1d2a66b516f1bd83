"""structlog as JSON lines on stdout: one line per request (see gateway.middleware), cheap to emit."""

from __future__ import annotations

import logging
import sys

import msgspec
import structlog

_encode = msgspec.json.Encoder().encode
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def _serialize(event: dict, **_: object) -> bytes:
    try:
        return _encode(event)
    except TypeError:
        return _encode({key: str(value) for key, value in event.items()})


def configure_logging(level: str = "info") -> None:
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=_serialize),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.BytesLoggerFactory(sys.stdout.buffer),
        cache_logger_on_first_use=True,
    )
