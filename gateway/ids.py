"""Identifiers for requests and usage events: 32 hex digits, time-ordered.

The ledger indexes both (`usage_events.event_id` is its primary key, `request_id` has an index). With
random ids (uuid4) each inserted row lands on a random leaf of each index, so once an index has more
leaves than a batch has rows, a batch of 500 events dirties ~500 pages per index, all written to the
WAL and checkpointed again: the SQLite writer's CPU per event grew with the table (19 -> 48 us over
the first 100,000 rows here) and PostgreSQL's B-trees suffer the same. Ids that start with the time
land at the right edge of their index, a few pages per batch whatever the table's size.

The random part comes from the OS's CSPRNG (ids stay unguessable), but in slices of one `os.urandom`
call per 400 ids (`random_hex`, also for the other random ids made per request): a `getrandom`
syscall per id showed as 3% of a busy SQLite gateway's py-spy samples, and pooling it cut the
gateway's CPU per request by 3-5% (docs/benchmarks.md, "Zen 5").
"""

from __future__ import annotations

import itertools
import os
import re
import threading
import time
from contextvars import ContextVar, Token

# What a request id may be: the gateway's own (32 hex digits) and a client's `x-request-id` it keeps.
# One rule for every place that takes one (the request middleware, `POST /v1/feedback`): an id that
# fails it can never name a request, so what is stored under it could never be read back or joined.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")

_POOL_BYTES = 4000  # 400 ids per refill
_pool = b""
_taken = 0
_lock = threading.Lock()  # two threads must never take the same slice


def _forget_pool() -> None:
    # a forked worker must not hand out the ids its parent would
    global _pool, _taken, _lock
    _pool, _taken, _lock = b"", 0, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def random_hex(nbytes: int) -> str:
    """`os.urandom(nbytes).hex()` for nbytes up to `_POOL_BYTES`, without a syscall per call."""
    global _pool, _taken
    with _lock:
        if _taken + nbytes > len(_pool):
            _pool, _taken = os.urandom(_POOL_BYTES), 0
        start = _taken
        _taken += nbytes
    return _pool[start : start + nbytes].hex()


def is_request_id(value: str) -> bool:
    """Whether `value` can be a request's id (letters, digits, `._:-`, 1 to 128 of them)."""
    return _REQUEST_ID.fullmatch(value) is not None


def ordered_id() -> str:
    """Milliseconds since the epoch (12 hex digits, as in UUIDv7) then 80 random bits (20 hex digits):
    as unique as uuid4 for any practical purpose (80 random bits within one millisecond), sorted by
    creation time across milliseconds. A clock stepping back costs index locality, never uniqueness."""
    return f"{time.time_ns() // 1_000_000:012x}{random_hex(10)}"


# The HTTP exchange the running code serves, as a number unique in this process, when its request id
# came from the client (0 otherwise: the gateway's own ids are unique already). A client's
# `x-request-id` is kept as given, and one client may send the same id on many requests (an SDK built
# with a trace id in its default headers), concurrent or not: what the gateway keeps per request in
# memory (budget reservations, token estimates: gateway.accounting.admission) is keyed by both, or
# two exchanges sharing an id would settle and forget each other's. Set by the request middleware;
# the tasks started for the request (hedges, comparisons) inherit it.
exchange_tag: ContextVar[int] = ContextVar("weir_exchange_tag", default=0)
_tags = itertools.count(1)


def tag_exchange() -> Token[int]:
    """Give the exchange being served a tag of its own (see `exchange_tag`)."""
    return exchange_tag.set(next(_tags))


def exchange_key(request_id: str) -> str:
    """`request_id`, told apart from other exchanges that carry the same client-given id. (A space
    never occurs in a request id, so a tagged key cannot equal another request's id.)"""
    tag = exchange_tag.get()
    return f"{request_id} {tag}" if tag else request_id
