"""Disk full under the usage spool (no Redis): events wait in memory, the file is never torn, and
every event reaches the reader exactly once when space returns. The full disk is played at the
spool's write seam: a write that stores part of its bytes and then fails with ENOSPC, as a real
filesystem does when it fills mid-write."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import random
from pathlib import Path

import pytest

from gateway.accounting.events import UsageEvent
from gateway.accounting.queue import SpoolQueue
from gateway.usage import Usage
from tests.control.events import usage_event


def event(rng: random.Random) -> UsageEvent:
    return usage_event(
        os.urandom(8).hex(),
        route="gpt-4o-mini",
        backend="openai",
        model="gpt-4o-mini",
        usage=Usage(input_tokens=rng.randint(0, 5000), output_tokens=rng.randint(0, 5000)),
        cost_pico_usd=rng.randint(0, 10**9),
    )


class FillingDisk:
    """Takes `room` more bytes, then every write fails with ENOSPC until `free()`."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.full_writes = 0

    def __call__(self, fd: int, data: bytes | bytearray) -> int:
        if self.room is None:
            return os.write(fd, data)
        if self.room == 0:
            self.full_writes += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        written = os.write(fd, bytes(data[: self.room]))
        self.room -= written
        return written

    def free(self) -> None:
        self.room = None  # type: ignore[assignment]


async def test_disk_full_delays_events_but_loses_and_tears_none(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    queue = SpoolQueue(tmp_path / "spool")
    disk = FillingDisk(room=1000)  # a few events' worth, ending mid-line
    queue._write = disk
    rng = random.Random(7)
    sent = [event(rng) for _ in range(200)]
    for item in sent[:100]:
        queue.put(item)
    await asyncio.sleep(0.05)  # the flush at the end of the loop turn hits the full disk

    got = [item for _, item in await queue.read(1000, block_s=0)]
    assert 0 < len(got) < 100 and disk.full_writes >= 1  # what fit whole is readable, nothing torn
    for item in sent[100:]:
        queue.put(item)  # the request path keeps queueing while the disk is full
    await asyncio.sleep(0.6)  # a retry fails again
    assert disk.full_writes >= 2

    disk.free()
    await asyncio.sleep(0.6)  # the next retry writes everything that waited
    batch = await queue.read(1000, block_s=0)  # nothing acked yet: the reader starts over
    tokens = [token for token, _ in batch]
    got = [item for _, item in batch]
    await queue.ack(tokens)
    assert queue.pending() == 0
    assert "skipping unreadable" not in caplog.text
    assert any(r.levelno == logging.WARNING and "spool write failed" in r.message for r in caplog.records)
    await queue.close()
    lines = b"".join(p.read_bytes() for p in sorted((tmp_path / "spool").glob("*.jsonl"))).splitlines()
    assert len(lines) == 200  # the file holds exactly the 200 lines, whole
