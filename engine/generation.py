"""One request's generation as the API sees it: engine outputs turned into text deltas (detokenised,
cut at stop strings, EOS hidden), the token counts usage is made of (engine/server.py `_usage`) and
latency metrics. Leaving early aborts the request."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from engine.output import IncrementalDetokenizer, TextStream
from engine.protocol import ApiError

if TYPE_CHECKING:
    from engine.async_engine import AsyncLLMEngine
    from engine.llm_engine import RequestOutput, TokenLogprob
    from engine.metrics import EngineMetrics
    from engine.sampling import SamplingParams


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # set on the last delta


class Generation:
    """Drives one request through the engine: detokenises, applies stop strings (aborting the request
    when one matches), records metrics, and keeps the usage numbers."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        metrics: EngineMetrics,
        prompt_ids: list[int],
        params: SamplingParams,
        stop: list[str],
        started: float,
        *,
        score_only: bool = False,
        include_stop: bool = False,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        # max_tokens=0 (scoring a prompt with echo + logprobs): the engine must generate one token to
        # run the prompt; it is dropped here and never shown or billed.
        self.score_only = score_only
        tokenizer = self.engine.engine.tokenizer
        hidden = frozenset(tokenizer.eos_token_ids) | frozenset(params.stop_token_ids)
        self.text = TextStream(
            IncrementalDetokenizer(tokenizer, prompt_ids),
            stop,
            hidden,
            keep_stop=include_stop,
            min_tokens=params.min_tokens,
        )
        self.prompt_ids = prompt_ids
        self.params = params
        self.started = started
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.finish_reason: str | None = None
        # vLLM's `stop_reason`: the stop string or stop_token_ids token that ended it; None for EOS,
        # the length limit, or not ended yet.
        self.stop_reason: str | int | None = None

    async def deltas(self) -> AsyncGenerator[Delta, None]:
        """The request's text and tokens as they come; the last delta carries the finish reason.
        Closing this early (client gone, stop string) aborts the request in the engine."""
        metrics = self.metrics
        outputs = self.engine.generate(self.prompt_ids, self.params, self.engine.new_request_id())
        accepted = False
        try:
            async with aclosing(outputs):
                try:
                    out: RequestOutput | None = await anext(outputs)
                except ValueError as exc:  # the engine rejected the request's parameters
                    raise ApiError(400, str(exc), param=getattr(exc, "param", None)) from exc
                accepted = True
                last_token_at: float | None = None
                while out is not None:
                    now = time.perf_counter()
                    if out.prompt_logprobs is not None:
                        self.prompt_logprobs = out.prompt_logprobs
                    self.num_cached_tokens = out.num_cached_tokens
                    if self.score_only:
                        out = replace(out, new_token_ids=[], new_logprobs=None)
                    self.num_output_tokens = 0 if self.score_only else out.num_output_tokens
                    fed = self.text.num_tokens
                    text = self.text.add(out.new_token_ids, finished=out.finished)
                    if self.text.stopped:
                        self.finish_reason, self.stop_reason = "stop", self.text.matched
                        # a speculative step's ids past the one that completed the stop string are
                        # neither shown nor billed
                        used = self.text.num_tokens - fed
                        self.num_output_tokens -= len(out.new_token_ids) - used
                        out = replace(out, new_token_ids=out.new_token_ids[:used])
                    elif out.finished:
                        self.finish_reason = "length" if self.score_only else out.finish_reason
                        self.stop_reason = None if self.score_only else out.stop_token_id
                    # after the stop-string cut: the tokens generated are the tokens billed
                    if n := len(out.new_token_ids):
                        if last_token_at is None:
                            metrics.ttft.observe(now - self.started)
                        else:
                            for _ in range(n):
                                metrics.itl.observe((now - last_token_at) / n)
                        last_token_at = now
                        metrics.observe_tokens(n, now)
                    yield Delta(text, list(out.new_token_ids), out.new_logprobs, self.finish_reason)
                    if self.finish_reason is not None:
                        return
                    out = await anext(outputs, None)
        finally:
            if accepted:  # "abort": the client went away before the end
                metrics.finish(
                    self.finish_reason or "abort",
                    len(self.prompt_ids),
                    self.num_cached_tokens,
                    self.started,
                    time.perf_counter(),
                )
