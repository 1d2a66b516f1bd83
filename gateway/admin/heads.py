"""Admin API for trained difficulty heads: `/admin/api/v1/difficulty-heads` (list, read, upload,
download, delete).

A head is uploaded as a bundle (routing.heads: one safetensors file, what `weir router heads export`
writes) in the body of `PUT /difficulty-heads/{name}`. It is checked whole before it is stored, so
a bad file changes nothing; a difficulty route then names it in `head`. Every replica loads it within
its poll interval, and a head replaced under the same name is swapped in the same way. A head that
routes name cannot be deleted.
"""

from __future__ import annotations

import asyncio
from typing import Any

from litestar import Request, Response, delete, get, put

from gateway.admin.router import AdminContext, AdminError
from gateway.db.models import DifficultyHeadRow
from routing.difficulty import DifficultyHead
from routing.heads import (
    HeadStore,
    check_name,
    describe,
    listed,
    put_head,
    routes_naming,
    stored_bundle,
    unbundle,
)


def _store(request: Request) -> HeadStore | None:
    return request.app.state.gateway.router.heads


def _named(name: str) -> str:
    try:
        check_name(name)
    except ValueError as exc:
        raise AdminError(400, str(exc), "invalid_value", "name") from None
    return name


async def _row(session: Any, name: str) -> DifficultyHeadRow:
    row = await session.get(DifficultyHeadRow, _named(name))
    if row is None:
        raise AdminError(404, f"no difficulty head named {name!r}", "not_found", "name")
    return row


def _shown(row: DifficultyHeadRow, store: HeadStore | None) -> dict[str, Any]:
    # What this replica serves: another replica may still be loading a head just replaced.
    loaded = store.get(row.name) if store is not None else None
    return {**describe(row), "loaded_here": loaded is not None and loaded.digest == row.digest}


@get("/difficulty-heads")
async def list_heads(request: Request, ctx: AdminContext) -> dict[str, Any]:
    async with ctx.sessions() as session:
        rows = await listed(session)
    store = _store(request)
    return {"data": [_shown(row, store) for row in rows]}


@get("/difficulty-heads/{name:str}")
async def get_head(name: str, request: Request, ctx: AdminContext) -> dict[str, Any]:
    async with ctx.sessions() as session:
        row = await _row(session, name)
        used_by = [r.id for r in await routes_naming(session, row.name)]
        return {**_shown(row, _store(request)), "meta": row.meta, "routes": used_by}


@get("/difficulty-heads/{name:str}/bundle", media_type="application/octet-stream")
async def download_head(name: str, ctx: AdminContext) -> Response[bytes]:
    async with ctx.sessions() as session:
        found = await stored_bundle(session, _named(name))
    if found is None:
        raise AdminError(404, f"no difficulty head named {name!r}", "not_found", "name")
    return Response(
        found[1],
        media_type="application/octet-stream",
        headers={"content-disposition": f'attachment; filename="{name}.safetensors"'},
    )


@put("/difficulty-heads/{name:str}", status_code=200)
async def upload_head(name: str, request: Request, ctx: AdminContext) -> Response[dict[str, Any]]:
    _named(name)
    data = await request.body()
    try:
        # Reading and checking a few MB of arrays: off the event loop.
        head: DifficultyHead = await asyncio.to_thread(unbundle, data)
    except ValueError as exc:
        raise AdminError(400, str(exc), "invalid_value", "body") from None
    async with ctx.write() as (session, audit):
        row, before = await put_head(session, name, data, head)
        after = describe(row)
        audit("update" if before else "create", "difficulty_head", name, before, after)
    store = _store(request)
    if store is not None:
        await store.refresh()  # this replica starts loading it now; the others within a poll
    return Response(_shown(row, store), status_code=200 if before else 201)


@delete("/difficulty-heads/{name:str}", status_code=204)
async def delete_head(name: str, request: Request, ctx: AdminContext) -> None:
    async with ctx.write() as (session, audit):
        row = await _row(session, name)
        used_by = await routes_naming(session, row.name)
        if used_by:
            ids = ", ".join(str(r.id) for r in used_by)
            raise AdminError(
                409,
                f"difficulty head {name!r} is in use by routes {ids}; change them first",
                "conflict",
                "name",
            )
        audit("delete", "difficulty_head", row.name, describe(row), None)
        await session.delete(row)
    store = _store(request)
    if store is not None:
        await store.refresh()


HEAD_HANDLERS = [list_heads, get_head, download_head, upload_head, delete_head]
