"""Difficulty heads trained on a tenant's own outcomes, served by the difficulty routes that name them.

The shipped head learned from MMLU and ranks prompts unlike MMLU little better than their length does
(docs/routing.md). A tenant whose traffic differs fits its own: `weir router train --tenant` learns
from its `POST /v1/feedback` scores, `weir router heads install` (or `PUT
/admin/api/v1/difficulty-heads/{name}`) stores the result in the admin DB, and a difficulty route with
`head: <name>` routes by it on every replica within a poll interval, without a restart.

A head travels as one file, a *bundle*: its arrays in safetensors format, its metadata (version,
embedder recipe, training source) as JSON in the safetensors header under `BUNDLE_KEY`. A bundle is
checked whole before it is stored (`unbundle`), so a replica never loads one that would fail on its
first prompt.

Each replica keeps the table's (name, digest) pairs fresh by polling a signature, as routes do, and
loads off the event loop every head a route in force names; a head replaced under the same name is
loaded, then swapped in. Until a route's head is loaded (or when it cannot be: deleted, unreadable) the
route is scored by the shipped head, and its `x-weir-route` says so; where the shipped head is not
loaded either, a request waits for the head's load in flight instead of starting a second load.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.db.models import DifficultyHeadRow, RouteRow, utcnow
from gateway.db.poller import TablePoller
from routing.difficulty import HEAD_META, HEAD_WEIGHTS, DifficultyClassifier, DifficultyHead
from routing.routes import HEAD_NAME

log = structlog.get_logger("weir.routing")
BUNDLE_KEY = "weir_difficulty_head"
# Changes whenever a head is added, replaced (revisions) or deleted (count).
SIGNATURE = select(
    func.count(DifficultyHeadRow.name),
    func.max(DifficultyHeadRow.updated_at),
    func.sum(DifficultyHeadRow.revision),
)
# Scored once after loading, so the first routed request does not pay for first-call set-up.
_WARM_PROMPT = "Is this a hard question?"


def bundle(head: DifficultyHead) -> bytes:
    from safetensors.numpy import save

    return save(head.tensors(), metadata={BUNDLE_KEY: json.dumps(head.meta, sort_keys=True)})


def unbundle(data: bytes) -> DifficultyHead:
    """The head in a bundle; ValueError saying what is wrong with it."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    header_len = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if not 0 < header_len <= len(data) - 8:
        raise ValueError(
            "not a difficulty head bundle: expected a safetensors file (an 8-byte header length, then a "
            "JSON header of that length)"
        )
    try:
        header = json.loads(data[8 : 8 + header_len])
        meta = json.loads(header["__metadata__"][BUNDLE_KEY])
    except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: JSON nested too deep
        raise ValueError(
            f"not a difficulty head bundle: a safetensors file whose header metadata has {BUNDLE_KEY!r}"
        ) from None
    if not isinstance(meta, dict):
        raise ValueError(f"not a difficulty head bundle: {BUNDLE_KEY!r} must be a JSON object")
    try:
        tensors = load(data)
    except SafetensorError as exc:
        raise ValueError(f"not a difficulty head bundle: {exc}") from None
    return DifficultyHead.from_tensors(tensors, meta, "the bundle")


def read_bundle(path: Path) -> bytes:
    """A bundle from a head directory (what `weir router train --out` writes) or a bundle file;
    ValueError when it holds no valid head."""
    if path.is_dir():
        if not (path / HEAD_WEIGHTS).exists() or not (path / HEAD_META).exists():
            raise ValueError(f"{path} holds no difficulty head ({HEAD_WEIGHTS} and {HEAD_META})")
        return bundle(DifficultyHead.load(path))
    data = path.read_bytes()
    unbundle(data)
    return data


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def json_safe(value: Any) -> Any:
    """`value` with NaN and infinities as null: a head's metadata may hold them (an AUC of rows all of
    one kind is NaN), and strict JSON, PostgreSQL's json type included, has no such values."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(item) for item in value]
    return value


def check_name(name: str) -> None:
    if not HEAD_NAME.fullmatch(name):
        raise ValueError(
            f"invalid head name {name!r}: 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )


def classifier_from_bundle(data: bytes) -> DifficultyClassifier:
    """A ready classifier: the head, the process's embedder for its recipe, one prompt scored."""
    from routing.embed import shared_embedder

    head = unbundle(data)
    classifier = DifficultyClassifier(head, shared_embedder(head.embedder))
    classifier.score(_WARM_PROMPT)
    return classifier


def describe(row: DifficultyHeadRow) -> dict[str, Any]:
    """A head as the admin API and the CLI show it (never the bytes)."""
    meta = row.meta or {}
    return {
        "name": row.name,
        "digest": row.digest,
        "embedder": row.embedder,
        "size": row.size,
        "version": meta.get("version"),
        "source": meta.get("source"),
        "rows": meta.get("rows"),
        "weak_labelled": meta.get("weak_labelled"),
        "strong_labelled": meta.get("strong_labelled"),
        "holdout": meta.get("holdout"),  # `weir router train --holdout`: against the shipped head
        # What the blend weighs (`TrainConfig.blend_inputs`); heads trained before version 5, components.
        "blend_inputs": meta.get("blend_inputs", "components"),
        "created_at": row.created_at.isoformat(),
        "updated_at": row.updated_at.isoformat(),
    }


async def listed(session: AsyncSession) -> list[DifficultyHeadRow]:
    """Every stored head by name, without its bytes."""
    query = select(DifficultyHeadRow).order_by(DifficultyHeadRow.name)  # `bundle` is a deferred column
    return list((await session.scalars(query)).all())


async def stored_bundle(session: AsyncSession, name: str) -> tuple[str, bytes] | None:
    """The digest and bytes of the head stored as `name`: the one read of the deferred column."""
    row = (
        await session.execute(
            select(DifficultyHeadRow.digest, DifficultyHeadRow.bundle).where(DifficultyHeadRow.name == name)
        )
    ).one_or_none()
    return None if row is None else (row[0], row[1])


async def routes_naming(session: AsyncSession, name: str) -> list[RouteRow]:
    """The routes whose `head` is `name` (a head they name cannot be deleted)."""
    rows = (await session.scalars(select(RouteRow).order_by(RouteRow.position, RouteRow.id))).all()
    return [row for row in rows if (row.spec or {}).get("head") == name]


async def put_head(
    session: AsyncSession, name: str, data: bytes, head: DifficultyHead
) -> tuple[DifficultyHeadRow, dict[str, Any] | None]:
    """Store bundle `data` (`head` is what `unbundle` read from it) under `name`, added or replacing
    the head of that name; returns the row and, when it replaced one, what that was."""
    row = await session.get(DifficultyHeadRow, name)
    before = describe(row) if row is not None else None
    now = utcnow()
    if row is None:
        row = DifficultyHeadRow(name=name, created_at=now)
        session.add(row)
    row.digest, row.embedder, row.size = digest(data), head.embedder, len(data)
    row.meta, row.bundle, row.updated_at = json_safe(head.meta), data, now
    await session.flush()
    return row, before


@dataclass(frozen=True)
class TrainedHead:
    name: str
    digest: str
    classifier: DifficultyClassifier

    @property
    def label(self) -> str:
        """How the route header and the ledger name it: which head, which version of it."""
        return f"{self.name}@{self.digest[:12]}"


class HeadStore:
    """This replica's loaded trained heads: those the routes in force name, as the admin DB has them."""

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        interval: float = 1.0,
        load: Callable[[bytes], DifficultyClassifier] | None = None,  # default: classifier_from_bundle
        on_unavailable: Callable[[], None] = lambda: None,
    ) -> None:
        self.sessions = sessions
        self.load = load
        self.on_unavailable = on_unavailable  # a wanted head is missing or failed to load
        self.heads: dict[str, TrainedHead] = {}
        self.digests: dict[str, str] | None = None  # the table's name -> digest, once read
        self.wanted: frozenset[str] = frozenset()
        self.failed: dict[str, tuple[str, str]] = {}  # name -> (digest, why) of a bundle that did not load
        self.signature: tuple[Any, ...] | None = None
        self._retry = False  # a load could not read the DB: poll it again even if nothing changed
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._poller = TablePoller(
            self.refresh,
            interval,
            "difficulty_heads",
            sessions=sessions,
            signature_query=SIGNATURE,
            current=lambda: None if self._retry else self.signature,
        )

    async def start(self) -> None:
        await self.refresh()
        self._poller.start()

    async def stop(self) -> None:
        await self._poller.stop()
        # A load in a thread cannot be cancelled: let it finish.
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def get(self, name: str) -> TrainedHead | None:
        return self.heads.get(name)

    async def loaded(self, name: str) -> TrainedHead | None:
        """`name` once its load in flight (if any) has finished."""
        task = self._tasks.get(name)
        if task is not None and not task.done():
            await asyncio.shield(task)  # a cancelled request must not cancel the load
        return self.heads.get(name)

    def status(self, name: str) -> str:
        """Why `name` is not served, or "loaded": loading, missing (no such head), failed."""
        if name in self.heads:
            return "loaded"
        stored = self.digests.get(name) if self.digests is not None else None
        if self.digests is not None and stored is None:
            return "missing"
        if stored is not None and self.failed.get(name, ("", ""))[0] == stored:
            return "failed"
        return "loading"

    def pending(self) -> list[asyncio.Task[None]]:
        return [task for task in self._tasks.values() if not task.done()]

    def want(self, names: Collection[str]) -> None:
        """The heads the routes in force name: load what is missing, let go of the rest."""
        self.wanted = frozenset(names)
        for name in set(self.heads) - self.wanted:
            del self.heads[name]
        # And what was kept about loads of heads no route names now (a finished task each, a failed
        # bundle's error): one entry per head name ever named, for as long as the replica ran. A
        # head named again is loaded (or its bundle tried) afresh.
        for name in [name for name, task in self._tasks.items() if task.done() and name not in self.wanted]:
            del self._tasks[name]
        for name in set(self.failed) - self.wanted:
            del self.failed[name]
        self._sync()

    async def refresh(self) -> None:
        async with self.sessions() as session:
            signature = tuple((await session.execute(SIGNATURE)).one())
            rows = (await session.execute(select(DifficultyHeadRow.name, DifficultyHeadRow.digest))).all()
        self.digests = {name: row_digest for name, row_digest in rows}
        self.signature, self._retry = signature, False
        self._sync()

    def _sync(self) -> None:
        if self.digests is None:  # the table is not read yet: start() reads it, then comes back here
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        for name in sorted(self.wanted):
            want = self.digests.get(name)
            if want is None:
                if self.heads.pop(name, None) is not None:
                    log.warning("difficulty_head_gone", head=name)
                self.on_unavailable()
                continue
            loaded = self.heads.get(name)
            if loaded is not None and loaded.digest == want:
                continue
            if self.failed.get(name, ("", ""))[0] == want:
                continue  # this bundle failed to load; a new one under the name is tried
            task = self._tasks.get(name)
            if task is None or task.done():
                self._tasks[name] = loop.create_task(self._load(name))

    async def _load(self, name: str) -> None:
        started = time.perf_counter()
        try:
            async with self.sessions() as session:
                found = await stored_bundle(session, name)
        except Exception as exc:  # the DB briefly away: the next poll tries again
            self._retry = True
            log.warning("difficulty_head_read_failed", head=name, error=str(exc))
            return
        if found is None:
            self._sync()
            return
        row_digest, data = found
        try:
            classifier = await asyncio.to_thread(self.load or classifier_from_bundle, data)
        except Exception as exc:  # a bundle stored by hand, or an embedder this replica cannot build
            self.failed[name] = (row_digest, str(exc))
            log.error("difficulty_head_load_failed", head=name, digest=row_digest[:12], error=str(exc))
            if name not in self.heads:  # else the version loaded before keeps serving
                self.on_unavailable()
            return
        self.failed.pop(name, None)
        if name in self.wanted:
            self.heads[name] = TrainedHead(name, row_digest, classifier)
            log.info(
                "difficulty_head_loaded",
                head=name,
                digest=row_digest[:12],
                embedder=classifier.embedder.recipe,
                seconds=round(time.perf_counter() - started, 3),
            )
        self._sync()  # replaced again while this one loaded
