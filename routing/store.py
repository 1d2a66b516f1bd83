"""Routes in the admin DB: seeded once from the config's `routes:`, then edited through the admin API.

Every replica polls a cheap signature of the table (row count, last update, id sum) and reloads the
whole table when it changes, so an edit reaches every replica within `interval` seconds without a
restart. Every load serves the rows that validate on this replica and leaves out each one that does
not (a model removed from the config, a row another version wrote), listed in `left_out` and logged
when it is first left out, when its reason changes and when it loads again or is gone.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import structlog
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from gateway.db.models import RouteRow, Setting
from gateway.db.poller import TablePoller
from routing.routes import Route

log = structlog.get_logger("weir.routing")
SEEDED = "routes_seeded"
# Changes whenever a route is added, edited (revisions, in any order of commits) or deleted (count, id sum).
SIGNATURE = select(
    func.count(RouteRow.id), func.max(RouteRow.updated_at), func.sum(RouteRow.id), func.sum(RouteRow.revision)
)


async def stamp(session: Any, now: dt.datetime) -> dt.datetime:
    """The `updated_at` for a route written `now` (the writer's clock): later than every stamp in the
    table. Replicas reload on a change of SIGNATURE, which an edit moves only through the latest
    stamp; one stamped earlier (a replica or the training job with a clock behind, a wall clock
    stepped back) left it as it was, and the other replicas never saw that edit."""
    latest = await session.scalar(select(func.max(RouteRow.updated_at)))
    if latest is not None and latest >= now:
        return latest + dt.timedelta(microseconds=1)  # as precise as PostgreSQL's timestamps
    return now


def row_route(row: RouteRow) -> Route:
    return msgspec.convert(row.spec, Route)


def route_spec(route: Route) -> dict[str, Any]:
    return msgspec.to_builtins(route)


class LeftOut(msgspec.Struct, frozen=True):
    """A stored route this replica does not serve, and why."""

    id: int
    name: str
    error: str


class RouteStore:
    def __init__(
        self,
        sessions: Any,
        apply: Any,
        seed: Sequence[Route],
        interval: float = 1.0,
        check: Callable[[Route], None] | None = None,
    ) -> None:
        self.sessions = sessions  # async_sessionmaker
        self.apply = apply  # Callable[[list[Route]], None]: raises ValueError on a table it refuses
        # Raises ValueError for a route that cannot be served here; without it, rows are only decoded.
        self.check = check
        self.seed = list(seed)
        self.interval = interval
        self.signature: tuple[Any, ...] | None = None
        # The rows the latest load left out; and why the latest table read was refused as a whole
        # (None once a table is in force), in which case the routes loaded before it stay in force.
        self.left_out: list[LeftOut] = []
        self.rejected: str | None = None
        # The rows the latest load found it could not serve, as logged, by id (see `_log_left_out`).
        self._logged_left_out: dict[int, LeftOut] = {}
        # One load at a time: a poll that read the table before an admin write must not apply its
        # older rows after the write's own refresh.
        self._loading = asyncio.Lock()
        self._poller = TablePoller(
            self.refresh,
            interval,
            "routes",
            sessions=sessions,
            signature_query=SIGNATURE,
            current=lambda: self.signature,
        )

    async def start(self) -> None:
        await self._seed()
        await self.refresh()
        self._poller.start()

    async def stop(self) -> None:
        await self._poller.stop()

    async def _seed(self) -> None:
        # Once per database, not once per start: routes an admin deleted stay deleted. The settings
        # row's primary key makes concurrent first starts of several replicas seed exactly once.
        try:
            async with self.sessions() as session, session.begin():
                if await session.get(Setting, SEEDED) is not None:
                    return
                session.add(Setting(key=SEEDED, value="1"))
                await session.flush()
                for position, route in enumerate(self.seed):
                    session.add(RouteRow(name=route.name, position=position, spec=route_spec(route)))
        except IntegrityError:
            return

    async def refresh(self, force: bool = False) -> bool:
        """Reload the table if it changed; True when new routes were applied."""
        async with self._loading:
            async with self.sessions() as session:
                signature = tuple((await session.execute(SIGNATURE)).one())
                if signature == self.signature and not force:
                    return False
                rows = (
                    await session.scalars(select(RouteRow).order_by(RouteRow.position, RouteRow.id))
                ).all()
            # Saved whatever the outcome: the same table would fare the same on a retry.
            self.signature = signature
            return self._load(rows)

    def _load(self, rows: Sequence[RouteRow]) -> bool:
        """Serve the rows that validate one by one; log and leave out each one that does not. One row
        that cannot be served here (its model removed from this replica's config, a spec another
        version wrote) must not hold back every other route's edits, nor, at start, bring back the
        config's seed (routes an admin deleted, edits reverted). What `apply` checks across rows
        still decides for the table as a whole: refused, the routes in force stay as they are."""
        routes: list[Route] = []
        left_out: list[LeftOut] = []
        for row in rows:
            try:
                route = row_route(row)
                if self.check is not None:
                    self.check(route)
            except (msgspec.ValidationError, ValueError) as exc:
                left_out.append(LeftOut(id=row.id, name=row.name, error=str(exc)))
                continue
            routes.append(route)
        self._log_left_out(left_out)
        try:
            self.apply(routes)
        except ValueError as exc:
            if str(exc) != self.rejected:
                log.error("routes_rejected", error=str(exc))
            self.rejected = str(exc)
            return False
        if self.rejected is not None:
            log.info("routes_rejected_cleared", previous_error=self.rejected)
        self.left_out, self.rejected = left_out, None
        log.info("routes_loaded", routes=len(routes), left_out=len(left_out))
        return True

    def _log_left_out(self, left_out: Sequence[LeftOut]) -> None:
        """Log a row left out when first found or when its reason changes, and once (info) when it
        loads again or is gone; not again on every load it stays left out. Every edit to any route
        reloads the table on every replica, so logging each load repeated the same errors once per edit
        per replica, burying new ones. `left_out` (and the gauge) are still set on every load applied."""
        found = {r.id: r for r in left_out}
        for row in left_out:
            before = self._logged_left_out.get(row.id)
            if before is None or before.error != row.error:
                log.error("route_left_out", route_id=row.id, name=row.name, error=row.error)
        for route_id, row in self._logged_left_out.items():
            if route_id not in found:
                log.info("route_left_out_cleared", route_id=route_id, name=row.name)
        self._logged_left_out = found
