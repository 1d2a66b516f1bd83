"""The one HTTP client pool every backend shares (aiohttp: ~13x the throughput of httpx's default
transport under concurrency here), with the timeouts of `config.Timeouts` and an SSE reader.

Transport failures become the gateway's own errors: refused connection -> 503, timeouts -> 504,
anything else that breaks the exchange -> 502. Those that never reached an answer (no connection, the
connect timeout, a connection dropped before any response) are `Unreachable` too.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import aiohttp
import structlog

from gateway.config import Timeouts
from gateway.errors import BadGateway, CannotConnect, ConnectTimeout, DroppedBeforeAnswer, GatewayTimeout
from gateway.logging import redact_keys
from gateway.providers.base import UpstreamRequest

MAX_ERROR_BODY = 64 * 1024  # enough of a vendor's error body to show its message
MAX_RESPONSE_BODY = 64 * 1024 * 1024  # a non-streaming response larger than this is a broken backend
# Stable codes for a connection that broke after the backend answered: clients can tell an answer cut
# short from a refusal without parsing the message.
STREAM_INTERRUPTED = "upstream_stream_interrupted"
RESPONSE_INTERRUPTED = "upstream_response_interrupted"

log = structlog.get_logger("weir.gateway")


@dataclass(slots=True)
class UpstreamResponse:
    status: int
    headers: Mapping[str, str]
    raw: aiohttp.ClientResponse
    received: int = 0  # bytes of a whole body read so far in pieces (decompressed), for `body_size`


@functools.lru_cache(maxsize=256)
def _client_timeout(timeouts: Timeouts, stream: bool) -> aiohttp.ClientTimeout:
    # Streams may go quiet between chunks for `read` seconds; a whole response is bounded by the
    # first-byte timeout (headers) and then `read` (body) in Transport.read.
    return aiohttp.ClientTimeout(
        total=None, sock_connect=timeouts.connect, sock_read=timeouts.read if stream else None
    )


class Transport:
    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
            # auto_decompress stays on: vendors gzip; skip_auto_headers keeps requests lean.
            self._session = aiohttp.ClientSession(connector=connector, skip_auto_headers=("User-Agent",))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def send(self, request: UpstreamRequest, timeouts: Timeouts, backend: str) -> UpstreamResponse:
        """Send a request and wait for the response headers (not the body)."""
        try:
            async with asyncio.timeout(timeouts.first_byte):
                response = await self.session.request(
                    request.method,
                    request.url,
                    data=request.body,
                    headers=request.headers,
                    timeout=_client_timeout(timeouts, request.stream),
                    # Followed, a redirect re-sent the vendor key (`x-api-key`, `x-goog-api-key`: aiohttp
                    # drops only `Authorization` across origins) and, on 307/308, the prompt to wherever
                    # the Location said, an internal address included, and echoed its answer back.
                    allow_redirects=False,
                )
        except aiohttp.ConnectionTimeoutError:  # a TimeoutError too: the connect timeout's own
            raise ConnectTimeout(
                f"cannot connect to backend {backend} within {timeouts.connect:g}s"
            ) from None
        except TimeoutError:
            raise GatewayTimeout(
                f"backend {backend} did not answer within {timeouts.first_byte:g}s"
            ) from None
        except aiohttp.ClientConnectorError as exc:
            raise CannotConnect(f"cannot connect to backend {backend}: {exc.strerror or exc}") from None
        except aiohttp.ClientError as exc:
            log.warning("upstream_request_broken", backend=backend, error=describe(exc))
            if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError):
                raise DroppedBeforeAnswer(_before_answer(backend, exc)) from None
            raise BadGateway(_before_answer(backend, exc)) from None
        if 300 <= response.status < 400:
            response.close()
            # Where it pointed goes to the log only: a client has no business with the backend's URLs.
            log.warning(
                "upstream_redirect_refused",
                backend=backend,
                status=response.status,
                location=_without_query(response.headers.get("location", "")),
            )
            raise BadGateway(
                f"backend {backend} answered with a redirect ({response.status}), which the gateway "
                "does not follow: set the backend's base_url to where it points"
            )
        return UpstreamResponse(response.status, response.headers, response)

    async def read(self, response: UpstreamResponse, timeouts: Timeouts, backend: str, limit: int) -> bytes:
        raw = response.raw
        try:
            async with asyncio.timeout(timeouts.read):
                # The length header bounds the body only when nothing inflates it: a compressed body's
                # counts compressed bytes (a 100 KB gzip can hold 100 MB), so those are read in chunks.
                encoded = raw.headers.get("content-encoding", "identity").lower() != "identity"
                if raw.content_length is not None and raw.content_length <= limit and not encoded:
                    return await raw.read()
                body = bytearray()
                async for chunk in raw.content.iter_any():
                    body += chunk
                    response.received = len(body)
                    if len(body) > limit:
                        raw.close()
                        raise BadGateway(f"backend {backend} sent a response larger than {limit} bytes")
                return bytes(body)
        except TimeoutError:
            raise GatewayTimeout(f"backend {backend} stopped sending its response") from None
        except aiohttp.ClientError as exc:
            log.warning("upstream_response_broken", backend=backend, error=describe(exc))
            raise BadGateway(
                f"the response from backend {backend} ended before it was complete", code=RESPONSE_INTERRUPTED
            ) from None
        finally:
            raw.release()

    async def events(
        self, response: UpstreamResponse, backend: str
    ) -> AsyncIterator[list[tuple[str | None, str]]]:
        """Server-sent events as (event name, data) pairs, in batches: the events completed by one
        network read. Writing a batch downstream in one piece keeps the syscalls per stream close to
        the upstream's own. Comments and retry/id fields are skipped. A read that completes no event
        (a keep-alive, part of a long line) yields an empty batch, so the caller can tell a backend
        that only keeps the connection warm from one that makes progress. An event larger than
        MAX_RESPONSE_BODY is a broken backend (502), not a reason to buffer without end."""
        event: str | None = None
        data: list[str] = []
        size = 0  # bytes of the event being read: its data lines so far
        received = 0  # whole events read: how far a stream that breaks got, for the client's message
        pending = bytearray()
        try:
            async for piece in response.raw.content.iter_any():
                pending += piece
                if b"\n" not in piece:  # no line ends here: nothing to parse (and nothing to copy)
                    if len(pending) + size > MAX_RESPONSE_BODY:
                        raise BadGateway(
                            f"backend {backend} sent a stream event larger than {MAX_RESPONSE_BODY} bytes"
                        )
                    yield []
                    continue
                *lines, rest = pending.split(b"\n")
                pending = rest
                batch: list[tuple[str | None, str]] = []
                for raw_line in lines:
                    try:
                        line = raw_line.decode("utf-8").rstrip("\r")
                    except UnicodeDecodeError:
                        # The events before the broken line are whole: hand them on (as they would
                        # be had the network split the read there), then fail.
                        if batch:
                            yield batch
                        raise
                    if not line:
                        if data:
                            batch.append((event, "\n".join(data)))
                            received += 1
                        event, data, size = None, [], 0
                    elif line.startswith("data:"):
                        data.append(line[6:] if line.startswith("data: ") else line[5:])
                        size += len(raw_line)
                    elif line.startswith("event:"):
                        event = line[6:].strip()
                if len(pending) + size > MAX_RESPONSE_BODY:
                    raise BadGateway(
                        f"backend {backend} sent a stream event larger than {MAX_RESPONSE_BODY} bytes"
                    )
                yield batch
            last = pending.decode("utf-8").rstrip("\r")
            if last.startswith("data:"):
                data.append(last[6:] if last.startswith("data: ") else last[5:])
            if data:
                yield [(event, "\n".join(data))]
        except TimeoutError:
            raise GatewayTimeout(f"backend {backend} went silent mid-stream") from None
        except aiohttp.ClientError as exc:
            log.warning("upstream_stream_broken", backend=backend, events=received, error=describe(exc))
            raise BadGateway(
                f"the stream from backend {backend} ended unexpectedly after {received} events",
                code=STREAM_INTERRUPTED,
            ) from None
        except UnicodeDecodeError as exc:
            log.warning("upstream_stream_broken", backend=backend, events=received, error=describe(exc))
            raise BadGateway(f"backend {backend} sent a stream event that is not UTF-8 text") from None
        finally:
            response.raw.release()

    def discard(self, response: UpstreamResponse) -> None:
        response.raw.close()


def body_size(response: UpstreamResponse) -> int | None:
    """How large a whole answer's body is, as far as known when it was not read to its end: its
    `content-length` when nothing inflates it (exact); else (chunked, or compressed: the length counts
    compressed bytes) the least it is known to be, the larger of what `Transport.read` had of it
    (decompressed) and its compressed length; None when neither says anything. Never more than
    MAX_RESPONSE_BODY: a larger body is refused."""
    length = response.headers.get("content-length", "")
    announced = int(length) if length.isdigit() else None
    if announced is not None and response.headers.get("content-encoding", "identity").lower() == "identity":
        return min(announced, MAX_RESPONSE_BODY)
    least = max(response.received, announced or 0)
    return min(least, MAX_RESPONSE_BODY) if least else None


def _before_answer(backend: str, exc: aiohttp.ClientError) -> str:
    """What a client is told of a request that broke before any response headers: what happened, in
    words that stay the same across aiohttp versions (the log has aiohttp's own)."""
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError):
        return f"backend {backend} closed the connection before answering"
    if isinstance(exc, aiohttp.ClientResponseError):
        return f"backend {backend} sent a response that is not valid HTTP"
    return f"the request to backend {backend} failed before it answered"


def _without_query(url: str) -> str:
    # A query string may carry a key (`?key=`, as Google's APIs take one): never logged.
    return url.split("?", 1)[0]


# A URL's query string inside an exception's text (aiohttp's name the request's URL).
_QUERY = re.compile(r"(https?://[^\s'\"?#]*)\?[^\s'\"#)]*")


def describe(exc: BaseException) -> str:
    """An exception for the log: its class and its text, any URL in it without its query string
    (a backend's configured query parameters may hold its key), and whatever in it looks like a key
    (`redact_keys`: a decoder's error may quote the vendor's body, a connection error a header)."""
    text = redact_keys(_QUERY.sub(r"\1?[query]", str(exc)))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
