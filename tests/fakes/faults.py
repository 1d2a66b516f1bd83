"""Faults a fake vendor can inject into its next responses.

Build one with a constructor and queue it with ``fake.fail_next(fault, times=n)``::

    fake.fail_next(Fault.status(429, retry_after=2))   # the vendor's own 429 body + retry-after header
    fake.fail_next(Fault.status(429, retry_delay=30))  # Gemini: the hint in the body (RetryInfo), no header
    fake.fail_next(Fault.status(429, error_code="insufficient_quota"))  # OpenAI: out of credit, not a rate limit
    fake.fail_next(Fault.delay(1.5))                    # first byte (headers) after 1.5 s, then normal
    fake.fail_next(Fault.hang())                        # never answers (until reset() or stop())
    fake.fail_next(Fault.reset())                       # TCP RST before any byte
    fake.fail_next(Fault.cut_stream(after=3))           # 3 chunks, then the connection drops (no terminator)
    fake.fail_next(Fault.stream_error(after=3))         # 3 chunks, then the vendor's in-stream error event
    fake.fail_next(Fault.end_stream(after=3))           # 3 chunks, then the body ends in good order
    fake.fail_next(Fault.slow_stream(0.2))              # normal reply, 0.2 s between stream chunks
    fake.fail_next(Fault.stall(after=3))                # 3 chunks (JSON: half the body), then silence
    fake.fail_next(Fault.garbage())                     # 200 with a body that is not the vendor's format
    fake.fail_next(Fault.wrong_content_type())          # 200 text/html, like a proxy's error page
    fake.fail_next(Fault.huge(20_000_000))              # a valid reply whose text is ~20 MB

A bare int is accepted as shorthand for ``Fault.status(code)``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FaultKind(enum.Enum):
    STATUS = "status"
    DELAY = "delay"
    HANG = "hang"
    RESET = "reset"
    CUT_STREAM = "cut_stream"
    STREAM_ERROR = "stream_error"
    END_STREAM = "end_stream"
    SLOW_STREAM = "slow_stream"
    STALL = "stall"
    GARBAGE = "garbage"
    WRONG_CONTENT_TYPE = "wrong_content_type"
    HUGE = "huge"


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    status_code: int = 0  # STATUS and STREAM_ERROR: the vendor status whose error body is sent
    retry_after: float | None = None  # STATUS: value of the retry-after header
    # STATUS: Gemini's retry hint, in seconds, where Google puts it: a RetryInfo entry of the error
    # body's `details` (`"retryDelay": "30s"`), with no header. Vendors without such a body ignore it.
    retry_delay: float | None = None
    # STATUS: the vendor's error code (OpenAI: `insufficient_quota`; Gemini: its `status`, e.g.
    # `FAILED_PRECONDITION`, in place of the one its HTTP status names)
    code: str | None = None
    message: str | None = None  # STATUS and STREAM_ERROR: overrides the vendor's default message
    seconds: float = 0.0  # DELAY: before the first byte; SLOW_STREAM: between chunks
    after: int = 0  # CUT_STREAM, STREAM_ERROR, END_STREAM and STALL: chunks sent before the failure
    size: int = 0  # HUGE: approximate bytes of reply text

    @classmethod
    def status(
        cls,
        code: int,
        *,
        retry_after: float | None = None,
        message: str | None = None,
        retry_delay: float | None = None,
        error_code: str | None = None,
    ) -> Fault:
        return cls(
            FaultKind.STATUS,
            status_code=code,
            retry_after=retry_after,
            message=message,
            retry_delay=retry_delay,
            code=error_code,
        )

    @classmethod
    def delay(cls, seconds: float) -> Fault:
        return cls(FaultKind.DELAY, seconds=seconds)

    @classmethod
    def hang(cls) -> Fault:
        return cls(FaultKind.HANG)

    @classmethod
    def reset(cls) -> Fault:
        return cls(FaultKind.RESET)

    @classmethod
    def cut_stream(cls, after: int = 1) -> Fault:
        return cls(FaultKind.CUT_STREAM, after=after)

    @classmethod
    def stream_error(cls, after: int = 1, code: int = 500, message: str | None = None) -> Fault:
        return cls(FaultKind.STREAM_ERROR, after=after, status_code=code, message=message)

    @classmethod
    def end_stream(cls, after: int = 1) -> Fault:
        """`after` chunks, then the body ends as a whole body does (no error, no broken connection)
        without the rest, its terminator (`[DONE]`, `message_stop`) too: a vendor or a proxy on the
        way that ends a stream early, which only the stream's own content tells."""
        return cls(FaultKind.END_STREAM, after=after)

    @classmethod
    def stall(cls, after: int = 1) -> Fault:
        """`after` chunks (a JSON reply: its headers and half its body), then nothing more until
        `reset()` or `stop()`, which drop the connection: a backend gone silent mid-answer."""
        return cls(FaultKind.STALL, after=after)

    @classmethod
    def slow_stream(cls, seconds: float) -> Fault:
        return cls(FaultKind.SLOW_STREAM, seconds=seconds)

    @classmethod
    def garbage(cls) -> Fault:
        return cls(FaultKind.GARBAGE)

    @classmethod
    def wrong_content_type(cls) -> Fault:
        return cls(FaultKind.WRONG_CONTENT_TYPE)

    @classmethod
    def huge(cls, size: int = 20_000_000) -> Fault:
        from tests.fakes.util import huge_words  # (util imports this module)

        huge_words(size)  # made now, in the test, not while the request waits for its headers
        return cls(FaultKind.HUGE, size=size)
