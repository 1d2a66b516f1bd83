"""Routes in the admin DB: seeded once from the config's `routes:`, then edited through the admin API.

Every replica polls a cheap signature of the table (row count, last update, id sum) and reloads the
whole table when it changes, so an edit reaches every replica within `interval` seconds without a
restart. A table that fails validation (e.g. a model removed from the config) is logged and the
previous routes stay in force.
"""

from __future__ import annotations

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
        self.apply = apply  # Callable[[list[Route]], None]: raises on an invalid table
        # Raises ValueError for a route that cannot be served here (see _first_load).
        self.check = check
        self.seed = list(seed)
        self.loaded = False  # whether routes from the table are in force (not the config's seed)
        self.interval = interval
        self.signature: tuple[Any, ...] | None = None
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
        async with self.sessions() as session:
            signature = tuple((await session.execute(SIGNATURE)).one())
            if signature == self.signature and not force:
                return False
            rows = (await session.scalars(select(RouteRow).order_by(RouteRow.position, RouteRow.id))).all()
        routes: list[Route] = []
        try:
            for row in rows:
                try:
                    routes.append(row_route(row))
                except msgspec.ValidationError as exc:
                    # A spec that no longer decodes (written by another version, edited by hand) is
                    # a table that no longer validates, like one naming a removed model.
                    raise ValueError(f"route id {row.id} ({row.name}): {exc}") from None
            self.apply(routes)
        except ValueError as exc:
            log.error("routes_rejected", error=str(exc))
            if not self.loaded:
                return self._first_load(rows, signature)
            return False
        finally:
            self.signature = signature
        self.loaded = True
        log.info("routes_loaded", routes=len(routes))
        return True

    def _first_load(self, rows: Sequence[RouteRow], signature: tuple[Any, ...]) -> bool:
        """The table does not validate as a whole on this replica's first load (a model removed from
        the config, a row a newer version wrote). Keeping "the routes in force" would mean the
        config's seed here: routes an admin deleted would come back and every edit be reverted. So
        the rows that validate are served and each one that does not is logged and left out."""
        routes: list[Route] = []
        for row in rows:
            try:
                route = row_route(row)
                if self.check is not None:
                    self.check(route)
            except (msgspec.ValidationError, ValueError) as exc:
                log.error("route_left_out", route_id=row.id, name=row.name, error=str(exc))
                continue
            routes.append(route)
        try:
            self.apply(routes)
        except ValueError as exc:  # not expected: each route was checked on its own
            log.error("routes_rejected", error=str(exc))
            return False
        self.loaded = True
        log.info("routes_loaded", routes=len(routes), left_out=len(rows) - len(routes))
        return True
