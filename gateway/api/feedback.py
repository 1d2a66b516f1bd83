"""`POST /v1/feedback {request_id, score}`: outcome feedback on a request, for evaluating routing and
refitting the difficulty head on a tenant's own traffic. Stored in the admin DB under the caller's
tenant; a tenant reads (`GET /v1/feedback/{request_id}`) and overwrites only its own."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, Response, get, post
from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite

from gateway.api.common import begin, json_response, parse_body
from gateway.db.models import Feedback, utcnow
from gateway.errors import GatewayError, InvalidRequest, NotFound
from gateway.ids import is_request_id


class FeedbackBody(msgspec.Struct, forbid_unknown_fields=True):
    request_id: str
    score: float  # 0 (bad) .. 1 (good)


def _sessions(request: Request[Any, Any, Any]) -> Any:
    sessions = request.app.state.gateway.router.sessions
    if sessions is None:
        raise GatewayError(
            "Feedback needs the control plane (set database_url).", status=501, code="not_implemented"
        )
    return sessions


def _json(row: Feedback) -> dict[str, Any]:
    return {
        "request_id": row.request_id,
        "score": row.score,
        "created_at": row.created_at.isoformat(),
        "updated_at": row.updated_at.isoformat(),
    }


@post("/v1/feedback", status_code=200)
async def post_feedback(request: Request[Any, Any, Any]) -> Response[Any]:
    _, call = await begin(request, "feedback")
    body = await parse_body(request, FeedbackBody)
    if not 0.0 <= body.score <= 1.0:
        raise InvalidRequest("'score' must be between 0 and 1.", param="score")
    # Only an id a request can carry: feedback stored under any other (a "/" in it, say) could be
    # neither read back (GET /v1/feedback/{id}) nor joined with the ledger, yet was answered 200.
    if not is_request_id(body.request_id):
        raise InvalidRequest(
            "'request_id' must be the x-request-id of a reply: 1 to 128 letters, digits or `._:-`.",
            param="request_id",
        )
    tenant = call.principal.tenant_id or "anonymous"
    async with _sessions(request)() as session, session.begin():
        # Insert unless the row exists, in one statement, then read it locked: with a read first, two
        # requests scoring one request id at once (a client's retry while its first try is in flight)
        # both found no row, both inserted, and the second broke the unique constraint: a 500.
        now = utcnow()
        dialect = session.get_bind().dialect.name
        insert = (postgresql if dialect == "postgresql" else sqlite).insert  # these know ON CONFLICT
        await session.execute(
            insert(Feedback)
            .values(
                tenant_id=tenant, request_id=body.request_id, score=body.score, created_at=now, updated_at=now
            )
            .on_conflict_do_nothing(index_elements=["tenant_id", "request_id"])
        )
        row = await session.scalar(
            select(Feedback)
            .where(Feedback.tenant_id == tenant, Feedback.request_id == body.request_id)
            .with_for_update()
        )
        assert row is not None  # inserted above, or there already
        if row.score != body.score:
            row.score, row.updated_at = body.score, utcnow()
        await session.flush()
        data = _json(row)
    return json_response({"object": "feedback", **data})


@get("/v1/feedback/{request_id:str}")
async def get_feedback(request: Request[Any, Any, Any], request_id: str) -> Response[Any]:
    _, call = await begin(request, "feedback")
    tenant = call.principal.tenant_id or "anonymous"
    sessions, row = _sessions(request), None
    if is_request_id(request_id):  # no feedback can be stored under any other id
        async with sessions() as session:
            row = await session.scalar(
                select(Feedback).where(Feedback.tenant_id == tenant, Feedback.request_id == request_id)
            )
    if row is None:  # another tenant's feedback is reported exactly like none
        raise NotFound(f"No feedback for request `{request_id}`.", param="request_id")
    return json_response({"object": "feedback", **_json(row)})


ROUTES = [post_feedback, get_feedback]
