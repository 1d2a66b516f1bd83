"""structlog as JSON lines on stdout: one line per request (see gateway.middleware), cheap to emit.

Every line logged while a request is served (an upstream that broke, a breaker it opened) carries
that request's `request_id`, its `exchange_id` where the request id is the client's `x-request-id`
(which the client may send on other requests too: the gateway's own id of the exchange, as the
ledger has it, tells their lines apart), and its `tenant` and `model` (the public model name the client asked
for) once known: the names and values of its `request` line, so an operator can join them.
They come from `serving`, which the request middleware sets for the exchange: the tasks started for
the request (hedges) inherit it. A task that outlives its request (a loop some request happened to
start) inherits it too, but no longer adds it once the exchange is over: only what a request did is
tagged with it. A line's own field of the same name wins. A long-lived loop is started in a context
of its own (`gateway.aio.detached`): it carries no request's fields.

The modules (and libraries: uvicorn, granian, asyncio, aiohttp, SQLAlchemy, alembic) that log through
the standard library's `logging` write the same JSON lines, through structlog's `ProcessorFormatter`
on a root handler: `event` (the message), `level`, `timestamp`, `logger` (its name) and the request's
fields, so a log pipeline reading JSON lines from stdout meets nothing else there. So does what
Python would print as plain text on stderr: an exception that escapes the main thread
(`sys.excepthook`) or another thread (`threading.excepthook`), and one raised where nothing can
catch it (`sys.unraisablehook`: a finalizer, a generator closed by the collector), each as one
`uncaught_exception` line with its traceback in `exception`. asyncio's (a task's exception nobody
retrieved) already goes through its logger.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from contextvars import ContextVar
from types import TracebackType
from typing import Literal, Protocol, TextIO

import msgspec
import structlog
from structlog.typing import EventDict, WrappedLogger

_encode = msgspec.json.Encoder().encode
log = structlog.get_logger("weir.crash")
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class Served(Protocol):
    """What a log line says of the request it was written for (gateway.pipeline.RequestInfo)."""

    request_id: str
    exchange_id: str | None  # the gateway's own id where `request_id` is a client's, which others may share
    tenant: str | None
    model: str
    over: bool  # the exchange ended: the tasks it left behind are no longer its


# One variable read per log line, set once per request: the fields fill in as the request learns them
# (its tenant after authentication, its model after the body is read) with no rebinding.
serving: ContextVar[Served | None] = ContextVar("weir_serving", default=None)


class logging_for:  # lower case, as contextlib.suppress: read as `with logging_for(info):`
    """Tag what the running code, and the tasks it starts, log with `info`'s request until it ends.
    A class, not a @contextmanager: a generator costs 2 us per request, this 0.6."""

    __slots__ = ("info", "token")

    def __init__(self, info: Served) -> None:
        self.info = info

    def __enter__(self) -> None:
        self.token = serving.set(self.info)

    def __exit__(self, *_: object) -> None:
        self.info.over = True  # a task the request started that logs from now on is not doing its work
        serving.reset(self.token)


# The model name is the client's own text until a route or model takes it (a 404 otherwise): up to a
# request body's size, on every line of the request. Logged to the longest name a route can have.
MAX_LOGGED_MODEL = 200


def logged_model(name: str) -> str:
    """`name` for a log line: as it is, or its first MAX_LOGGED_MODEL characters and its length."""
    if len(name) <= MAX_LOGGED_MODEL:
        return name
    return f"{name[:MAX_LOGGED_MODEL]}...[{len(name)} characters]"


def add_request_fields(_logger: WrappedLogger, _method: str, event: EventDict) -> EventDict:
    info = serving.get()
    if info is None or info.over:
        return event
    event.setdefault("request_id", info.request_id)
    if info.exchange_id is not None:
        event.setdefault("exchange_id", info.exchange_id)
    if info.tenant is not None:
        event.setdefault("tenant", info.tenant)
    if info.model:
        event.setdefault("model", logged_model(info.model))
    return event


REDACTED = "[redacted]"

# What a credential looks like inside a vendor's words, whoever's it is (`_KEY_LIKE`): OpenAI's and
# Anthropic's keys (`sk-...`, `sk-ant-...`), whole or masked as OpenAI quotes a refused one
# (`sk-proj-****abcd`), Google's (`AIza...`), a bearer token (RFC 6750's characters); and
# (`_LONG_WORD`) any word holding a run of 24 or more letters and digits, both among them: a key with
# no known prefix (Azure's 32 hex digits, Groq's `gsk_...`, a token a proxy echoes back), never a
# model's name, whose words are short (`deepseek-r1-distill-qwen-32b`).
_KEY_LIKE = re.compile(r"\bsk-[\w\-*.]*[\w*]|\bAIza[\w\-]{8,}|(?<=\bBearer )[\w\-.~+/]+=*", re.IGNORECASE)
# A long word, then the run it must hold: two linear scans (one pattern for both backtracks, its time
# the square of a word's length).
_LONG_WORD = re.compile(r"[A-Za-z0-9+_\-]{24,}=*")
_LONG_RUN = re.compile(r"[A-Za-z0-9]{24,}")


def _opaque(word: re.Match[str]) -> str:
    text = word.group()
    if not _LONG_RUN.search(text):
        return text
    mixed = any(c.isdigit() for c in text) and any(c.isalpha() for c in text)
    return REDACTED if mixed else text


def redact_keys(text: str) -> str:
    """`text` (a vendor's error message, an exception's) for the log, with whatever looks like a
    credential blanked: a 401's message may quote part of the key the gateway sent, or all of it,
    and a log line outlives the key. It knows no backend's key (unlike `gateway.pipeline.redact_secrets`,
    which blanks the backend's own in what the client sees), so it blanks by shape: also a masked
    key's last characters and a long id (a request id of 32 hex digits), which the operator does not
    need to see why a key was refused."""
    return _LONG_WORD.sub(_opaque, _KEY_LIKE.sub(REDACTED, text))


def _serialize(event: dict, **_: object) -> bytes:
    try:
        return _encode(event)
    except TypeError:
        return _encode({key: str(value) for key, value in event.items()})


def _serialize_text(event: dict, **_: object) -> str:
    return _serialize(event).decode()  # a logging.Formatter's result is text


class _JSONHandler(logging.StreamHandler[TextIO]):
    """The root handler `configure_logging` installs: a class of its own, so configuring again
    replaces it rather than writing each line twice, and leaves others' handlers (pytest's) be."""


def stdlib_handler(stream: TextIO | None = None) -> logging.Handler:
    """stdlib log records as the JSON lines structlog writes (same fields, same rendering), on
    stdout unless told otherwise."""
    handler = _JSONHandler(sys.stdout if stream is None else stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                add_request_fields,
                structlog.processors.add_log_level,
                structlog.stdlib.add_logger_name,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
            ],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                structlog.processors.JSONRenderer(serializer=_serialize_text),
            ],
        )
    )
    return handler


def log_uncaught(
    exc_type: type[BaseException],
    exc: BaseException | None,
    tb: TracebackType | None,
    level: Literal["critical", "error"] = "critical",
    **fields: object,
) -> None:
    """One JSON line for an exception nothing caught, its traceback in `exception`. Should logging
    itself fail (stdout closed at exit), Python's own hook prints it: a crash never goes unsaid."""
    try:
        getattr(log, level)("uncaught_exception", exc_info=(exc_type, exc, tb), **fields)
    except Exception:
        if exc is not None:
            sys.__excepthook__(exc_type, exc, tb)


def _thread_hook(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:  # a thread's way to end, silent by default too
        return
    thread = args.thread.name if args.thread is not None else None
    log_uncaught(args.exc_type, args.exc_value, args.exc_traceback, "error", thread=thread)


def _unraisable_hook(args: sys.UnraisableHookArgs) -> None:
    try:
        where = f"{args.err_msg or 'Exception ignored in'}: {args.object!r}"
    except Exception:  # a repr that fails: the message alone
        where = args.err_msg or "Exception ignored"
    log_uncaught(args.exc_type, args.exc_value, args.exc_traceback, "error", where=where)


def configure_logging(level: str = "info", ours: tuple[str, ...] = ("gateway", "routing")) -> None:
    """JSON lines on stdout for structlog, the standard library and crashes; `ours` (the packages
    whose INFO lines are worth reading) log at `level`, other libraries at WARNING or above."""
    structlog.configure(
        processors=[
            add_request_fields,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=_serialize),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.BytesLoggerFactory(sys.stdout.buffer),
        cache_logger_on_first_use=True,
    )
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _JSONHandler)]:
        root.removeHandler(handler)
    root.addHandler(stdlib_handler())
    logging.captureWarnings(True)  # a library's DeprecationWarning too: a JSON line, not stderr text
    # Crashes too: Python writes them as plain text on stderr (a bad database URL, a thread that died).
    sys.excepthook = log_uncaught
    threading.excepthook = _thread_hook
    sys.unraisablehook = _unraisable_hook
    # Libraries keep the WARNING they had (Python's default; their INFO is chatter: a line per
    # migration step, per pool event); the gateway's own modules follow the configured level, as
    # its structlog lines do.
    root.setLevel(max(logging.WARNING, _LEVELS[level]))
    for name in ours:
        logging.getLogger(name).setLevel(_LEVELS[level])
