"""Usage events the ledger refused for their data, set aside durably instead of retried for ever.

A refusal about the data (PostgreSQL's SQLSTATE classes 22, data exception, and 23, integrity
constraint violation; SQLite's constraint and data errors; a number no column can hold) comes back
every time the same event is sent: retried with its batch, it stopped every tenant's accounting. The
batch writer writes what the database takes and appends the refused events here, one JSON line each:

    {"set_aside_at": "2026-12-05T19:52:40.123456+00:00", "reason": "22001",
     "error": "StringDataRightTruncationError: value too long for type character varying(200)",
     "event": {...the UsageEvent as the queue carries it (events.encode)...}}

A queued line that is no event at all (`events.Unreadable`: a spool line torn by a crash, an event
shape this version cannot read) is set aside in the same file with the line as text, not dropped:

    {"set_aside_at": "...", "reason": "unreadable", "error": "DecodeError: Input data was truncated",
     "raw": "{\"request_id\": \"half-wr"}

`weir db replay-usage FILE` writes them to the ledger once the cause is fixed (docs/accounting.md).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import hashlib
import os
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.accounting.events import Unreadable, UsageEvent, decode, encode

DEAD_LETTER_FILE = "dead-letter.jsonl"  # beside the spool's slots, under WEIR_USAGE_SPOOL
_REFUSED_CLASSES = ("22", "23")  # SQLSTATE classes: data exception, integrity constraint violation
UNREADABLE = "unreadable"  # the `reason` of a line set aside that is no event


def refusal(exc: BaseException) -> str | None:
    """Why the database refused a write for the data it was given (the SQLSTATE, SQLite's error name,
    or `OverflowError`), or None for any other failure (the database away, a timeout, a deadlock, a
    schema behind the code), which a retry may get past."""
    orig = (exc.orig if isinstance(exc, DBAPIError) else None) or exc
    sqlstate = str(getattr(orig, "sqlstate", None) or "")
    if sqlstate:
        return sqlstate if sqlstate[:2] in _REFUSED_CLASSES else None
    if isinstance(orig, sqlite3.IntegrityError | sqlite3.DataError):
        return str(getattr(orig, "sqlite_errorname", None) or orig.__class__.__name__)
    if isinstance(orig, OverflowError):  # SQLite's driver: an integer over 64 bits (PostgreSQL: 22003)
        return "OverflowError"
    return None


def error_text(exc: BaseException) -> str:
    """The driver's error class and the first line of its message (no statement, no parameters)."""
    orig = (exc.orig if isinstance(exc, DBAPIError) else None) or exc
    # asyncpg's error behind SQLAlchemy's adapter names the condition (StringDataRightTruncationError).
    named = orig.__cause__ if isinstance(orig.__cause__, Exception) else orig
    lines = str(orig).splitlines()
    message = lines[0] if lines else ""
    if message.startswith("<class "):  # the adapter's "<class 'asyncpg....Error'>: message"
        message = message.split(": ", 1)[-1]
    return f"{named.__class__.__name__}: {message}" if message else named.__class__.__name__


class SetAside(msgspec.Struct, frozen=True, omit_defaults=True):
    set_aside_at: dt.datetime
    reason: str
    error: str
    event: msgspec.Raw = msgspec.Raw(b"")  # the event's encoded line, as the queue carried it
    # Or, for a line that is no event (reason `unreadable`): the line as UTF-8 text (bytes that are
    # not UTF-8 as backslash escapes).
    raw: str | None = None


@dataclass(frozen=True)
class Refused:
    event: UsageEvent
    reason: str
    error: str


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(SetAside)


class DeadLetters:
    """An append-only file of refused events. Lines are appended in one write and synced to disk
    before the queue acknowledges their batch; several processes may share the file (O_APPEND, and an
    exclusive lock around each check-and-append).

    Writing is idempotent: a record already in the file (the same event id; for a line that is no
    event, the same text) is not appended again. A crash between the append and the queue's
    acknowledgement set the batch aside a second time on the next start, and the file held each of
    its records twice. The keys of the file's records are read once per process and then only the
    bytes appended since (by any process); a file moved aside (for `weir db replay-usage`) starts a
    fresh index."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._seen: set[str] = set()  # the keys (`_key`) of the records in the file
        self._read_to = 0  # how far the file has been read into `_seen`
        self._inode: int | None = None  # the file read (a new one at the path: read afresh)
        self._write = os.write  # the write seam (tests play a full disk here)

    def add(self, refused: list[Refused]) -> None:
        now = dt.datetime.now(dt.UTC)
        self._append([SetAside(now, r.reason, r.error, msgspec.Raw(encode(r.event))) for r in refused])

    def add_unreadable(self, lines: list[Unreadable]) -> None:
        now = dt.datetime.now(dt.UTC)
        self._append(
            [
                SetAside(now, UNREADABLE, u.error, raw=u.line.decode("utf-8", "backslashreplace"))
                for u in lines
            ]
        )

    def _append(self, records: list[SetAside]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released by the close
            torn = self._catch_up(fd)
            data = bytearray(b"\n" if torn else b"")
            for record in records:
                key = _key(record)
                if key not in self._seen:
                    self._seen.add(key)
                    data += _encoder.encode(record) + b"\n"
            view = memoryview(data)
            while view:  # a regular file takes it whole; a short write continues where it stopped
                view = view[self._write(fd, view) :]
            if data:
                os.fsync(fd)
            self._read_to = os.fstat(fd).st_size
        except BaseException:
            self._inode = None  # a write that failed part way: read the file afresh next time
            raise
        finally:
            os.close(fd)

    def _catch_up(self, fd: int) -> bool:
        """Add the keys of the records appended since the last call to `_seen`; whether the file ends
        inside a line (a write torn by a crash or a full disk), which the next record must not be
        glued to: together they would read as one line that is no record, and that record be lost."""
        stat = os.fstat(fd)
        if stat.st_ino != self._inode or stat.st_size < self._read_to:
            self._seen.clear()
            self._read_to, self._inode = 0, stat.st_ino
        if stat.st_size == self._read_to:
            return False
        line = b""
        with open(os.dup(fd), "rb") as f:  # its own descriptor: closing it keeps `fd` and its lock
            f.seek(self._read_to)
            for line in f:
                with contextlib.suppress(msgspec.DecodeError):  # a torn line, or no record
                    self._seen.add(_key(_decoder.decode(line)))
        return not line.endswith(b"\n")


def _key(record: SetAside) -> str:
    """What makes two records the same: the event's id, or the text of a line that is no event."""
    if record.raw is not None:
        return "raw:" + hashlib.sha256(record.raw.encode("utf-8", "surrogatepass")).hexdigest()
    return "event:" + _event_id_decoder.decode(bytes(record.event)).event_id


class _EventId(msgspec.Struct):
    event_id: str


_event_id_decoder = msgspec.json.Decoder(_EventId)


def read_dead_letters(path: str | os.PathLike[str]) -> Iterator[tuple[int, SetAside | None]]:
    """Each line of a dead-letter file by number: its record, or None for a line that is none (a
    line torn by a crash mid-write)."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield number, _decoder.decode(line)
            except msgspec.DecodeError:
                yield number, None


@dataclass
class Replayed:
    events: int = 0  # distinct events in the file
    written: int = 0  # now in the ledger
    duplicates: int = 0  # in the ledger already (replayed before, or written by a retry)
    refused: list[Refused] = field(default_factory=list)  # refused again
    # line numbers that hold no record, or a line set aside as unreadable that still reads as none
    unreadable: list[int] = field(default_factory=list)


async def replay(path: str | os.PathLike[str], engine: AsyncEngine, batch: int = 1000) -> Replayed:
    """Write the events of a dead-letter file to the ledger (`weir db replay-usage`), as the batch
    writer does: each once (by event id, however often it was set aside or replayed), with its rollups.
    The file is only read; those refused again are returned."""
    from gateway.accounting.writer import BatchWriter  # the writer imports this module

    result = Replayed()
    events: dict[str, UsageEvent] = {}
    for number, record in read_dead_letters(path):
        # A line set aside as unreadable is tried again: a later version may read an older shape.
        line = (
            None if record is None else record.raw.encode() if record.raw is not None else bytes(record.event)
        )
        try:
            event = decode(line) if line else None
        except msgspec.DecodeError:
            event = None
        if event is None:
            result.unreadable.append(number)
        else:
            events.setdefault(event.event_id, event)
    result.events = len(events)
    writer = BatchWriter(None, engine)  # type: ignore[arg-type]  # writes only, reads no queue
    pending = list(events.values())
    for start in range(0, len(pending), batch):
        chunk = pending[start : start + batch]
        new, refused = await writer.write_what_is_taken(chunk)
        result.written += new
        result.duplicates += len(chunk) - new - len(refused)
        result.refused += refused
    return result
