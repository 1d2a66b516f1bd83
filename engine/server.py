"""OpenAI-compatible HTTP server for the bundled engine (aiohttp: it served a small JSON endpoint ~25%
faster than Litestar on uvicorn here, and the engine server needs no more than routing and SSE).

Endpoints: `/v1/chat/completions`, `/v1/completions` (with `echo` + `logprobs` for prompt scoring),
`/v1/models`, vLLM's `/tokenize` and `/detokenize`, `/health` (200 only once the model is loaded),
`/metrics` (Prometheus). Errors use the OpenAI shape `{"error": {"message", "type", "param", "code"}}`.
A client that disconnects cancels its handler (aiohttp `handler_cancellation`), which aborts the
request in the engine and frees its blocks."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from contextlib import aclosing, contextmanager, suppress
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from engine.async_engine import AsyncLLMEngine, EngineDeadError
from engine.generation import Generation
from engine.metrics import EngineMetrics
from engine.output import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    CompletionLogprobs,
    TextOffsets,
    chat_logprobs,
    parse_tool_calls,
)
from engine.protocol import (
    UNSUPPORTED_PARAMETER,
    UNSUPPORTED_VALUE,
    ApiError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    param_of,
    unsupported,
)
from engine.registry import ModelNotFoundError
from engine.sampling import JsonFormat
from gateway.parent_watch import watch_parent_from_env

if TYPE_CHECKING:
    from engine.llm_engine import EngineStats, TokenLogprob
    from engine.sampling import SamplingParams
    from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)
_Req = TypeVar("_Req", ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest)
_T = TypeVar("_T")

_LOADER = web.AppKey("loader", asyncio.Task)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # the legacy API's default
MAX_BODY_BYTES = 32 * 1024 * 1024
# The `retry-after` of a 503 `model_not_ready` (the model still loading): a hint for a client calling
# the engine itself. A small model loads in seconds, a large one in a minute or more; a client that
# polls every few seconds loses little either way. (Weir's gateway does not wait for it: it fails
# over at once, `routing.execute.retries_in_place`.)
LOADING_RETRY_AFTER_S = 5
# Seconds a stopping engine (SIGTERM) gives its in-flight generations before it cancels them (aiohttp's
# default, made explicit): the deployments' grace periods must exceed it (tests/deploy pins them).
DRAIN_TIMEOUT_S = 60.0


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), status=status, content_type="application/json")


def _error(exc: ApiError) -> web.Response:
    response = _json(exc.body(), status=exc.status)
    response.headers.update(exc.headers)
    return response


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return _error(exc)
    except web.HTTPException as exc:  # unknown route, wrong method
        if exc.status < 400:
            raise
        return _error(ApiError(exc.status, exc.reason or "error", code=str(exc.status)))
    except EngineDeadError as exc:
        return _error(ApiError(503, str(exc), code="engine_dead"))
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return _error(ApiError(500, "internal server error", type="server_error"))


# --- the server ---------------------------------------------------------------------------------------


class EngineServer:
    """The HTTP app. It can start before the model is loaded (`/health` says 503 until `attach`)."""

    def __init__(
        self,
        engine: AsyncLLMEngine | None = None,
        *,
        model_name: str | None = None,
        aliases: tuple[str, ...] = (),
        max_queued: int | None = None,
    ) -> None:
        self.engine: AsyncLLMEngine | None = None
        self.model_name = model_name
        self.aliases = aliases
        self.max_queued = max_queued
        self.held = 0  # sequences of requests being served: running, or queued for a batch slot
        self.created = int(time.time())
        self.load_error: str | None = None
        self.metrics = EngineMetrics(self._stats)
        self.app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
        self.app.add_routes(
            [
                web.post("/v1/chat/completions", self.chat_completions),
                web.post("/v1/completions", self.completions),
                web.get("/v1/models", self.list_models),
                web.get("/v1/models/{model}", self.get_model),
                web.post("/tokenize", self.tokenize),
                web.post("/detokenize", self.detokenize),
                web.get("/health", self.health),
                web.get("/metrics", self.metrics_endpoint),
            ]
        )
        self.app.on_cleanup.append(self._shutdown)
        self.app.on_response_prepare.append(self._load_report)
        if engine is not None:
            self.attach(engine, model_name)

    def attach(self, engine: AsyncLLMEngine, model_name: str | None = None) -> None:
        self.engine = engine
        self.model_name = model_name or self.model_name or engine.engine.model_name

    def ready(self) -> AsyncLLMEngine:
        if self.engine is None:
            raise ApiError(
                503,
                self.load_error or "the model is still loading",
                code="model_not_ready",
                headers={"retry-after": str(LOADING_RETRY_AFTER_S)},
            )
        if self.engine.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.engine.error!r}")
        return self.engine

    @contextmanager
    def _seats(self, engine: AsyncLLMEngine, sequences: int) -> Iterator[None]:
        """Holds `sequences` for the request's lifetime, or refuses it with a 429 when more than
        `max_queued` would wait behind a full batch: a gateway in front fails over at once rather than
        leave the request queued for seconds (unbounded, a burst's last request waits for all others)."""
        if self.max_queued is not None:
            capacity = engine.engine.scheduler.max_num_seqs + self.max_queued
            if self.held + sequences > capacity:
                self.metrics.refused.inc()
                raise ApiError(
                    429,
                    f"The engine is overloaded: {self.held} sequences running or queued, at most "
                    f"{capacity}; retry later or send the request to another backend.",
                    code="engine_overloaded",
                    headers={"retry-after": "1"},
                )
        self.held += sequences
        try:
            yield
        finally:
            self.held -= sequences

    def _stats(self) -> EngineStats | None:
        return self.engine.stats() if self.engine is not None else None

    async def _load_report(self, request: web.Request, response: web.StreamResponse) -> None:
        """ORCA's per-response load report, as vLLM writes it, when the request asks for one: a
        gateway with several replicas in front of several engines sees each engine's whole queue."""
        fmt = request.headers.get("endpoint-load-metrics-format", "").strip().upper()
        stats = self._stats() if fmt in ("TEXT", "JSON") else None
        if stats is None:
            return
        named = {
            "num_requests_running": stats.num_running,
            "num_requests_waiting": stats.num_waiting,
            # the model's cache, which new requests wait on (a draft model's never holds one up)
            "kv_cache_usage_perc": round(1 - stats.kv_blocks_free / max(stats.kv_blocks_total, 1), 4),
        }
        if fmt == "TEXT":
            value = "TEXT " + ", ".join(f"named_metrics.{k}={v:g}" for k, v in named.items())
        else:
            value = "JSON " + msgspec.json.encode({"named_metrics": named}).decode()
        response.headers["endpoint-load-metrics"] = value

    async def _shutdown(self, app: web.Application) -> None:
        if self.engine is not None:
            await self.engine.shutdown()

    # --- plumbing --------------------------------------------------------------------------------------

    async def _decode(self, request: web.Request, kind: type[_Req]) -> _Req:
        body = await request.read()
        try:
            req = msgspec.json.decode(body, type=kind)
        except msgspec.ValidationError as exc:
            raise ApiError(400, str(exc), param=param_of(exc)) from exc
        except msgspec.DecodeError as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
        if req.model not in (self.model_name, *self.aliases):
            raise ApiError(
                404, f"The model `{req.model}` does not exist.", param="model", code="model_not_found"
            )
        if isinstance(req, ChatCompletionRequest | CompletionRequest) and (refusal := unsupported(req)):
            raise refusal
        return req

    def _chat_prompt_ids(
        self,
        tokenizer: Tokenizer,
        messages: list[ChatMessage],
        tools: list[dict[str, Any]] | None,
        tools_used: bool,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """The conversation as the model's chat template writes it, in token ids. Tools are used when
        the template writes a tool prompt; otherwise the model never learns of them, and saying so
        beats silently ignoring them (as vLLM). `continue_final_message` (vLLM's): the final assistant
        message is left open, so the model goes on writing it."""
        dicts = [_message_dict(i, m) for i, m in enumerate(messages)]
        if tools_used and "tools" not in tokenizer.chat_template:
            raise ApiError(
                400,
                f"the chat template of {self.model_name} does not support tools",
                param="tools",
                code=UNSUPPORTED_PARAMETER,
            )
        if tools_used:
            _functions(tools)
        final = _final_text(messages) if continue_final_message else None
        if continue_final_message:
            if add_generation_prompt:
                raise ApiError(
                    400,
                    "continue_final_message and add_generation_prompt cannot both be true",
                    param="continue_final_message",
                )
            if final is None:
                raise ApiError(
                    400,
                    "continue_final_message: the final message must be an assistant message with text",
                    param="messages",
                )
        try:
            prompt = tokenizer.apply_chat_template(
                dicts, tools=tools, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # jinja errors, templates that raise on unsupported roles
            raise ApiError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc
        if final:
            prompt = _open_final_turn(prompt, final)
        return tokenizer.encode(prompt)

    def _max_tokens(
        self,
        requested: int | None,
        prompt_len: int,
        prompt_param: str,
        default: int | None = None,
        requested_param: str = "max_tokens",
    ) -> int:
        limit = self.ready().engine.max_model_len
        if prompt_len >= limit:  # the engine needs room for at least one generated token
            raise ApiError(
                400,  # as OpenAI and vLLM answer it: clients detect context_length_exceeded on a 400
                f"This model's maximum context length is {limit} tokens; the prompt has {prompt_len} tokens.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        room = limit - prompt_len
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                f"{requested} for the completion).",
                param=requested_param,
                code="context_length_exceeded",
            )
        return requested

    def _sampling(
        self, req: SamplingFields, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        from engine.sampling import SamplingParams

        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=max(req.top_k or 0, 0),  # vLLM uses -1 for "off"
            min_p=req.min_p or 0.0,
            seed=req.seed,
            stop_token_ids=list(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=req.repetition_penalty or 1.0,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=_logit_bias(req.logit_bias),
        )

    def _choices(
        self,
        n: int,
        prompt_ids: list[int],
        params: SamplingParams,
        stop: list[str],
        started: float,
        score_only: bool,
        include_stop: bool = False,
    ) -> list[Generation]:
        """`n` generations of one prompt. A seeded request's choice i draws with seed + i: each choice is
        reproducible, and none is a copy of another."""
        engine = self.ready()
        return [
            Generation(
                engine,
                self.metrics,
                prompt_ids,
                params if params.seed is None or i == 0 else replace(params, seed=params.seed + i),
                stop,
                started,
                score_only=score_only,
                include_stop=include_stop,
            )
            for i in range(n)
        ]

    @staticmethod
    def _stops(stop: str | list[str] | None) -> list[str]:
        if stop is None:
            return []
        return [stop] if isinstance(stop, str) else [s for s in stop if s]

    async def _sse(
        self, request: web.Request, chunks: AsyncGenerator[dict[str, Any], None]
    ) -> web.StreamResponse:
        """Streams chunks as server-sent events. The first chunk is computed before the headers go out,
        so a request the engine rejects still gets a proper 4xx."""
        async with aclosing(chunks):
            first = await anext(chunks, None)
            resp = web.StreamResponse(
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                    "X-Accel-Buffering": "no",
                }
            )
            await resp.prepare(request)
            # A client gone: a write can find its connection closing before aiohttp cancels the
            # handler. Leaving the `aclosing` block aborts its requests; there is nothing to write,
            # and raising made the middleware log an "unhandled error" and answer a 500 into the
            # closed stream (aiohttp ends a returned response quietly).
            with suppress(ConnectionError):
                await _write_events(request, resp, first, chunks)
            return resp

    # --- chat ------------------------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        engine = self.ready()
        req = await self._decode(request, ChatCompletionRequest)
        # tool calls are parsed from the reply only when the template writes a tool prompt
        parse_tools = bool(req.tools) and req.tool_choice != "none"
        prompt_ids = self._chat_prompt_ids(
            engine.engine.tokenizer,
            req.messages,
            req.tools,
            parse_tools,
            req.add_generation_prompt,
            req.continue_final_message,
        )
        # OpenAI's max_completion_tokens wins over the older max_tokens; an error names the one sent
        limit_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self._max_tokens(requested, len(prompt_ids), "messages", requested_param=limit_param)
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        # called without tools too: a call forced with none to make is the client's mistake, not text
        json_format = _structured_output(req, _forced_tool_call(req))
        params = replace(self._sampling(req, max_tokens, top_n), json_format=json_format)
        gens = self._choices(
            req.n,
            prompt_ids,
            params,
            self._stops(req.stop),
            started,
            score_only=False,
            include_stop=req.include_stop_str_in_output,
        )
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": req.model}
        with self._seats(engine, len(gens)):
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                head = {**head, "object": "chat.completion.chunk"}
                streams = [
                    self._chat_chunks(g, head, top_n, include_usage, parse_tools, i)
                    for i, g in enumerate(gens)
                ]
                return await self._sse(request, _with_usage(_merge(streams), head, [gens], include_usage))
            choices = await _all([self._chat_choice(i, g, top_n, parse_tools) for i, g in enumerate(gens)])
        return _json({**head, "object": "chat.completion", "choices": choices, "usage": _usage([gens])})

    async def _chat_choice(
        self, index: int, gen: Generation, top_n: int | None, parse_tools: bool
    ) -> dict[str, Any]:
        tokenizer = gen.engine.engine.tokenizer
        text: list[str] = []
        logprobs: list[TokenLogprob] = []
        async with aclosing(gen.deltas()) as deltas:
            async for d in deltas:
                text.append(d.text)
                if d.logprobs:
                    logprobs.extend(d.logprobs)
        message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
        finish_reason = gen.finish_reason
        if parse_tools:
            message["content"], calls = parse_tool_calls(message["content"])
            if calls:
                message["tool_calls"] = calls
                finish_reason = "tool_calls"
        return {
            "index": index,
            "message": message,
            "logprobs": {"content": chat_logprobs(tokenizer, logprobs, top_n)} if top_n is not None else None,
            "finish_reason": finish_reason,
            **_stop_reason(gen, finish_reason),
        }

    async def _chat_chunks(
        self,
        gen: Generation,
        head: dict[str, Any],
        top_n: int | None,
        include_usage: bool,
        parse_tools: bool,
        index: int,
    ) -> AsyncGenerator[dict[str, Any], None]:
        """One choice's chat chunks. With tools, the reply is held to the end: only then is it known
        to be a call."""
        tokenizer = gen.engine.engine.tokenizer
        extra = {"usage": None} if include_usage else {}

        def chunk(delta: dict[str, Any], finish: str | None = None, lp: Any = None) -> dict[str, Any]:
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            return {**head, "choices": [choice | _stop_reason(gen, finish)], **extra}

        held: list[str] = []
        role_sent = False
        async with aclosing(gen.deltas()) as deltas:
            async for d in deltas:
                if not role_sent:
                    role_sent = True
                    yield chunk({"role": "assistant", "content": ""})
                lp = None
                if top_n is not None and d.logprobs:
                    lp = {"content": chat_logprobs(tokenizer, d.logprobs, top_n)}
                if parse_tools:
                    held.append(d.text)
                    if lp is not None:
                        yield chunk({}, None, lp)
                    if d.finish_reason is None:
                        continue
                    content, calls = parse_tool_calls("".join(held))
                    if content:
                        yield chunk({"content": content})
                    if calls:
                        yield chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]})
                    yield chunk({}, "tool_calls" if calls else d.finish_reason)
                elif d.text or lp is not None or d.finish_reason is not None:
                    yield chunk({"content": d.text} if d.text else {}, d.finish_reason, lp)

    # --- legacy completions ----------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        engine = self.ready()
        req = await self._decode(request, CompletionRequest)
        tokenizer = engine.engine.tokenizer
        prompts = _prompt_list(req.prompt)
        json_format = _structured_output(req)
        groups: list[list[Generation]] = []  # per prompt, its n choices
        texts: list[str] = []
        for prompt in prompts:
            ids = tokenizer.encode_prompt(prompt) if isinstance(prompt, str) else prompt
            if not ids:
                raise ApiError(400, "the prompt is empty", param="prompt")
            if isinstance(prompt, list) and any(not 0 <= t < tokenizer.vocab_size for t in ids):
                raise ApiError(400, "the prompt holds a token id outside the vocabulary", param="prompt")
            max_tokens = self._max_tokens(req.max_tokens, len(ids), "prompt", DEFAULT_COMPLETION_MAX_TOKENS)
            prompt_lp = req.logprobs if req.echo and req.logprobs is not None else None
            params = self._sampling(req, max(max_tokens, 1), req.logprobs, prompt_lp)
            params = replace(params, json_format=json_format)
            texts.append(prompt if isinstance(prompt, str) else tokenizer.decode(ids))
            groups.append(
                self._choices(
                    req.n,
                    ids,
                    params,
                    self._stops(req.stop),
                    started,
                    score_only=max_tokens == 0,
                    include_stop=req.include_stop_str_in_output,
                )
            )
        # choice index = prompt index * n + choice, as OpenAI numbers a batch's choices
        choices = [(g, texts[p]) for p, group in enumerate(groups) for g in group]
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": req.model,
        }
        with self._seats(engine, len(choices)):
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                streams = [
                    self._completion_chunks(g, t, req, head, include_usage, i)
                    for i, (g, t) in enumerate(choices)
                ]
                return await self._sse(request, _with_usage(_merge(streams), head, groups, include_usage))
            done = await _all([self._completion_choice(i, g, t, req) for i, (g, t) in enumerate(choices)])
        return _json({**head, "choices": done, "usage": _usage(groups)})

    async def _completion_choice(
        self, index: int, gen: Generation, prompt_text: str, req: CompletionRequest
    ) -> dict[str, Any]:
        tokenizer = gen.engine.engine.tokenizer
        text = [prompt_text] if req.echo else []
        ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        async with aclosing(gen.deltas()) as deltas:
            async for d in deltas:
                text.append(d.text)
                ids.extend(d.token_ids)
                if d.logprobs:
                    logprobs.extend(d.logprobs)
        lp = None
        if req.logprobs is not None:
            lp = CompletionLogprobs()
            offsets = _text_offsets(tokenizer, gen, req.echo)
            if req.echo:
                lp.extend(tokenizer, gen.prompt_ids, _prompt_logprobs(gen), offsets)
            lp.extend(tokenizer, ids[: len(logprobs)], logprobs, offsets)
        return {
            "index": index,
            "text": "".join(text),
            "logprobs": lp.to_dict() if lp else None,
            "finish_reason": gen.finish_reason,
            **_stop_reason(gen, gen.finish_reason),
        }

    async def _completion_chunks(
        self,
        gen: Generation,
        prompt_text: str,
        req: CompletionRequest,
        head: dict[str, Any],
        include_usage: bool,
        index: int,
    ) -> AsyncGenerator[dict[str, Any], None]:
        tokenizer = gen.engine.engine.tokenizer
        extra = {"usage": None} if include_usage else {}
        offsets = _text_offsets(tokenizer, gen, req.echo)
        echoed = not req.echo
        async with aclosing(gen.deltas()) as deltas:
            async for d in deltas:
                text = d.text
                lp = None
                if req.logprobs is not None:
                    lp = CompletionLogprobs()
                if not echoed:
                    echoed = True
                    text = prompt_text + text
                    if lp is not None:
                        lp.extend(tokenizer, gen.prompt_ids, _prompt_logprobs(gen), offsets)
                if lp is not None and d.logprobs:
                    lp.extend(tokenizer, d.token_ids[: len(d.logprobs)], d.logprobs, offsets)
                if text or (lp is not None and lp.tokens) or d.finish_reason is not None:
                    yield {
                        **head,
                        "choices": [
                            {
                                "index": index,
                                "text": text,
                                "logprobs": lp.to_dict() if lp else None,
                                "finish_reason": d.finish_reason,
                                **_stop_reason(gen, d.finish_reason),
                            }
                        ],
                        **extra,
                    }

    # --- tokenize, detokenize (vLLM's) -----------------------------------------------------------------

    async def tokenize(self, request: web.Request) -> web.Response:
        """The token ids the model would be given: a chat completion's for `messages` (its
        `prompt_tokens`), a completion's for `prompt`."""
        engine = self.ready()
        req = await self._decode(request, TokenizeRequest)
        tokenizer = engine.engine.tokenizer
        if req.messages is not None:
            if req.prompt is not None:
                raise ApiError(400, "give either prompt or messages, not both", param="messages")
            tokens = self._chat_prompt_ids(
                tokenizer,
                req.messages,
                req.tools,
                bool(req.tools) and req.tool_choice != "none",
                req.add_generation_prompt,
                req.continue_final_message,
            )
        elif req.prompt is not None:
            # As a completion of the prompt gets it (BOS where the model wants one), or without special
            # tokens when asked.
            tokens = (
                tokenizer.encode_prompt(req.prompt)
                if req.add_special_tokens
                else tokenizer.encode(req.prompt)
            )
        else:
            raise ApiError(400, "either prompt or messages is required", param="prompt")
        return _json({"count": len(tokens), "max_model_len": engine.engine.max_model_len, "tokens": tokens})

    async def detokenize(self, request: web.Request) -> web.Response:
        engine = self.ready()
        req = await self._decode(request, DetokenizeRequest)
        tokenizer = engine.engine.tokenizer
        if any(not 0 <= t < tokenizer.vocab_size for t in req.tokens):
            raise ApiError(400, "tokens holds a token id outside the vocabulary", param="tokens")
        # special tokens kept, as vLLM does: the text of a chat prompt's ids is the templated prompt
        return _json({"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)})

    # --- models, health, metrics -----------------------------------------------------------------------

    def _model_card(self, name: str) -> dict[str, Any]:
        card: dict[str, Any] = {"id": name, "object": "model", "created": self.created, "owned_by": "weir"}
        if self.engine is not None:
            card["max_model_len"] = self.engine.engine.max_model_len
        return card

    async def list_models(self, request: web.Request) -> web.Response:
        self.ready()
        return _json({"object": "list", "data": [self._model_card(self.model_name or "")]})

    async def get_model(self, request: web.Request) -> web.Response:
        self.ready()
        name = request.match_info["model"]
        if name not in (self.model_name, *self.aliases):
            raise ApiError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        return _json(self._model_card(name))

    async def health(self, request: web.Request) -> web.Response:
        if self.engine is None:
            status = "error" if self.load_error else "loading"
            return _json({"status": status, "detail": self.load_error}, status=503)
        if not self.engine.is_running and self.engine.error is not None:
            return _json({"status": "error", "detail": repr(self.engine.error)}, status=503)
        return _json({"status": "ok", "model": self.model_name})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        resp = web.Response(body=self.metrics.render())
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp


async def _write_events(
    request: web.Request,
    resp: web.StreamResponse,
    first: dict[str, Any] | None,
    chunks: AsyncGenerator[dict[str, Any], None],
) -> None:
    """The stream's chunks as events, an error event if it fails after the headers are out, then
    `[DONE]`. A write to a client that is gone raises ConnectionError."""
    try:
        if first is not None:
            await _event(resp, first)
        async for chunk in chunks:
            await _event(resp, chunk)
    except ApiError as exc:
        await _event(resp, exc.body())
    except EngineDeadError as exc:
        await _event(resp, ApiError(503, str(exc), code="engine_dead").body())
    except ConnectionError:
        raise
    except Exception:
        # The headers are out: the middleware's 500 would be written into the chunked body (a client
        # reads "illegal chunk header", a connection error); an error event it can read.
        log.exception("unhandled error in the stream of %s %s", request.method, request.path)
        await _event(resp, ApiError(500, "internal server error", type="server_error").body())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()


async def _event(resp: web.StreamResponse, data: dict[str, Any]) -> None:
    await resp.write(b"data: " + msgspec.json.encode(data) + b"\n\n")


def _stop_reason(gen: Generation, finish: str | None) -> dict[str, Any]:
    """vLLM's `stop_reason` on a finished choice (a non-streamed one, a stream's chunk with its
    `finish_reason`): the stop string that ended it (Weir's gateway tells an Anthropic client
    `stop_sequence` and the string), the stop_token_ids token, or null (EOS, the length limit).
    Nothing on a stream's other chunks."""
    return {"stop_reason": gen.stop_reason} if finish is not None else {}


# content part types a chat message may hold, and the key of each one's text
TEXT_PARTS = {"text": "text", "refusal": "refusal"}


def _message_dict(index: int, message: Any) -> dict[str, Any]:
    """A message as chat templates expect it: `content` a string (text parts joined; an assistant's
    `refusal` parts are its text too, as vLLM reads them)."""
    content = message.content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            kind = part.get("type")
            if kind not in TEXT_PARTS:
                raise ApiError(
                    400,
                    f"content part of type {kind!r} is not supported",
                    param=f"messages[{index}].content",
                    code=UNSUPPORTED_VALUE,
                )
            text = part.get(TEXT_PARTS[kind])
            if not isinstance(text, str):  # a malformed part: the client's mistake, not another model's job
                raise ApiError(
                    400,
                    f"a {kind} content part needs a string `{TEXT_PARTS[kind]}`",
                    param=f"messages[{index}].content[{i}]",
                )
            parts.append(text)
        content = "".join(parts)
    out: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": content or "",
    }
    for key in ("name", "tool_call_id"):
        if (value := getattr(message, key)) is not None:
            out[key] = value
    if message.tool_calls is not None:
        out["tool_calls"] = [_template_tool_call(call) for call in message.tool_calls]
    return out


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call as chat templates expect it: `function.arguments` an object, not OpenAI's JSON text
    (Hugging Face's convention, which vLLM follows). Templates such as Qwen2.5's and Hermes' write
    `arguments | tojson`: JSON text came out as a quoted string, not the call the model had written."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call  # not JSON: the template gets the text as written
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def _final_text(messages: list[Any]) -> str | None:
    """The text of the final message when it is an assistant's with text (what continuing it needs)."""
    last = messages[-1]
    if last.role != "assistant" or last.tool_calls:
        return None
    text = _message_dict(len(messages) - 1, last)["content"]
    return text or None


def _open_final_turn(prompt: str, final: str) -> str:
    """The templated prompt cut where the final message's text ends, so the model goes on writing it:
    the template closes every turn (an end-of-turn token, a newline). Templates that trim each message
    (Llama 3's `| trim`) drop its trailing whitespace, a broken stream's usual end ("Steps:\\n\\n"):
    the cut then comes after its last visible character, with that whitespace put back, so the model
    goes on from exactly the text the client has (cut where the whole text is not found, the turn
    stayed closed and the model wrote past its end)."""
    end = prompt.rfind(final)
    if end >= 0:
        return prompt[: end + len(final)]
    visible = final.strip()
    end = prompt.rfind(visible) if visible else -1
    if end < 0:
        return prompt
    return prompt[: end + len(visible)] + final[len(final.rstrip()) :]


def _prompt_list(prompt: str | list[Any]) -> list[str | list[int]]:
    """`prompt` may be a string, a list of token ids, or a list of either (a batch)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if all(_is_token_id(t) for t in prompt):
        return [list(prompt)]
    for i, p in enumerate(prompt):
        if not (isinstance(p, str) or (isinstance(p, list) and all(_is_token_id(t) for t in p))):
            raise ApiError(400, "expected a string or a list of token ids", param=f"prompt[{i}]")
    return list(prompt)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text_offsets(tokenizer: Tokenizer, gen: Generation, echo: bool) -> TextOffsets:
    """A choice's `text_offset`s: from the echoed prompt's start, or from the completion's with the
    prompt as the detokenizer's context (as the choice's own text is decoded)."""
    return TextOffsets(tokenizer, () if echo else gen.prompt_ids)


def _prompt_logprobs(gen: Generation) -> list[TokenLogprob | None]:
    lps = gen.prompt_logprobs or []
    return list(lps) + [None] * (len(gen.prompt_ids) - len(lps))


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's `logit_bias` (token ids as JSON string keys) as token id -> bias; the engine checks the
    ids against the vocabulary."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            out[int(key)] = value
        except ValueError:
            raise ApiError(
                400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
    return out


def _structured_output(req: SamplingFields, forced: JsonFormat | None = None) -> JsonFormat | None:
    """The one grammar a request asks for: a forced tool call (chat), `response_format` or
    `guided_json`; asking for two is a 400 naming the later one."""
    fmt = _json_format(req)
    if forced is not None and fmt is not None:
        raise ApiError(
            400,
            "response_format cannot be combined with a forced tool_choice",
            param="response_format",
            code=UNSUPPORTED_PARAMETER,
        )
    guided = _guided_json(req)
    if guided is not None and (forced or fmt) is not None:
        raise ApiError(
            400,
            "guided_json cannot be combined with response_format or a forced tool_choice",
            param="guided_json",
        )
    return forced or fmt or guided


def _json_format(req: SamplingFields) -> JsonFormat | None:
    """OpenAI's `response_format`: `json_object` (any JSON object) or `json_schema` (`json_schema.schema`)."""
    fmt = req.response_format or {}
    if fmt.get("type") == "json_object":
        return JsonFormat()
    if fmt.get("type") != "json_schema":
        return None
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise ApiError(
            400, "response_format json_schema needs json_schema.schema, an object", param="response_format"
        )
    return JsonFormat(json.dumps(schema))


def _guided_json(req: SamplingFields) -> JsonFormat | None:
    """vLLM's `guided_json` (a JSON Schema, as an object or as JSON text): the same grammar as a
    `json_schema` response_format, on either endpoint."""
    schema = req.guided_json
    if schema is None:
        return None
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise ApiError(400, "guided_json must be a JSON Schema", param="guided_json") from None
    if not isinstance(schema, dict):
        raise ApiError(400, "guided_json must be a JSON Schema, an object", param="guided_json")
    return JsonFormat(json.dumps(schema), param="guided_json")


def _functions(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The function definitions in `tools`, each an object with a name, or a 400 naming `tools` (a
    template handed another shape renders nonsense, and reading one as an object was a 500)."""
    functions: list[Any] = [t.get("function") for t in tools or () if t.get("type") == "function"]
    if any(not isinstance(f, dict) or not isinstance(f.get("name"), str) for f in functions):
        raise ApiError(400, "every function in tools needs a `function` object with a name", param="tools")
    return functions


def _forced_tool_call(req: ChatCompletionRequest) -> JsonFormat | None:
    """`tool_choice` "required" or a named function as a grammar: the reply is one Hermes-style call
    block of one of those functions, with arguments that match its parameters' JSON Schema."""
    choice = req.tool_choice
    if choice in (None, "auto", "none"):
        return None
    functions = _functions(req.tools)
    if choice == "required":
        wanted = functions
    elif isinstance(choice, dict) and choice.get("type") == "function":
        named = choice.get("function")
        name = named.get("name") if isinstance(named, dict) else None
        if not isinstance(name, str):
            raise ApiError(400, "tool_choice needs `function` with the name of a tool", param="tool_choice")
        wanted = [f for f in functions if f["name"] == name]
        if not wanted:
            raise ApiError(400, f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
    else:
        raise ApiError(
            400, f"tool_choice {choice!r} is not supported", param="tool_choice", code=UNSUPPORTED_VALUE
        )
    if not wanted:
        raise ApiError(400, 'tool_choice "required" needs at least one function in tools', param="tools")
    schemas = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                "arguments": f.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in wanted
    ]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return JsonFormat(json.dumps(schema), TOOL_CALL_OPEN + "\n", "\n" + TOOL_CALL_CLOSE, param="tools")


def _usage(groups: list[list[Generation]]) -> dict[str, Any]:
    """Usage of a request: each prompt counted once however many choices it has (as OpenAI bills n > 1),
    its cached tokens those every choice read from the cache, and every choice's completion tokens."""
    prompt = sum(len(group[0].prompt_ids) for group in groups)
    cached = sum(min(g.num_cached_tokens for g in group) for group in groups)
    completion = sum(g.num_output_tokens for group in groups for g in group)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def _all(aws: list[Awaitable[_T]]) -> list[_T]:
    """`asyncio.gather`, except that the first failure cancels the rest (each holds an engine request,
    which cancelling aborts) and waits for them."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _merge(streams: list[AsyncGenerator[_T, None]]) -> AsyncGenerator[_T, None]:
    """The items of several streams as they come. An error in one ends them all; closing the merged
    stream (a client gone) closes every stream, which aborts their engine requests."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield item
        return
    queue: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()  # (finished, item or error)

    async def pump(stream: AsyncGenerator[_T, None]) -> None:
        try:
            async with aclosing(stream):
                async for item in stream:
                    await queue.put((False, item))
        except Exception as exc:
            await queue.put((True, exc))
        else:
            await queue.put((True, None))

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        running = len(tasks)
        while running:
            finished, item = await queue.get()
            if not finished:
                yield item
            elif item is not None:
                raise item
            else:
                running -= 1
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _with_usage(
    chunks: AsyncGenerator[dict[str, Any], None],
    head: dict[str, Any],
    groups: list[list[Generation]],
    include: bool,
) -> AsyncGenerator[dict[str, Any], None]:
    """The stream, then (if the client asked) one chunk with the whole request's usage."""
    async with aclosing(chunks):
        async for chunk in chunks:
            yield chunk
    if include:
        yield {**head, "choices": [], "usage": _usage(groups)}


async def start_server(server: EngineServer, host: str, port: int) -> web.AppRunner:
    """Serves `server` on host:port in the running loop; returns the runner (`await runner.cleanup()`)."""
    runner = web.AppRunner(server.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


# Load errors that say the model named is not there (a path that does not exist, a directory without its
# files, one this user may not read), besides the registry's ModelNotFoundError.
MISSING_MODEL = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def run(
    model: str,
    *,
    host: str,
    port: int,
    served_model_name: str | None,
    engine_kwargs: dict[str, Any],
    max_queued: int | None = None,
) -> int:
    """`weir engine serve`: binds at once (`/health` answers 503 while loading), loads the model in a
    thread, then serves until SIGINT/SIGTERM. Returns the exit status: 1 when the model failed to load,
    `os.EX_CONFIG` (78) when there is no such model to load (`MISSING_MODEL`): a supervisor gives up on
    that at once, where another failure (out of memory, a corrupt file) may be worth a few more tries."""
    server = EngineServer(model_name=served_model_name, aliases=(model,), max_queued=max_queued)
    missing = False

    async def load() -> None:
        from engine.llm_engine import LLMEngine

        try:
            llm = await asyncio.to_thread(LLMEngine, model, **engine_kwargs)
        except Exception as exc:
            nonlocal missing
            missing = isinstance(exc, (ModelNotFoundError, *MISSING_MODEL))
            server.load_error = f"could not load {model!r}: {exc}"
            log.error("%s", server.load_error)
            signal.raise_signal(signal.SIGTERM)  # run_app shuts down cleanly on SIGTERM
            return
        engine = AsyncLLMEngine(llm)
        engine.start()
        server.attach(engine, served_model_name)
        log.info("model %s loaded (max_model_len %d); ready", server.model_name, llm.max_model_len)

    async def start_loading(app: web.Application) -> None:
        app[_LOADER] = asyncio.create_task(load())

    server.app.on_startup.append(start_loading)
    watch_parent_from_env()  # started by a gateway: end with it
    sockets = listen(host, port)
    # The port bound, not the one asked for: `--port 0` leaves the choice to the system.
    log.info("listening on http://%s:%d, loading %s", host, sockets[0].getsockname()[1], model)
    web.run_app(
        server.app,
        sock=sockets,
        handler_cancellation=True,
        access_log=None,
        print=None,
        shutdown_timeout=DRAIN_TIMEOUT_S,
    )
    if server.load_error:
        return os.EX_CONFIG if missing else 1
    return 0


def listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address `host` resolves to, as aiohttp binds `host` and `port` itself,
    but bound here, where the port the system picks for port 0 can be read (one port for all of them)."""
    sockets: list[socket.socket] = []
    try:
        found = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys(found):  # once each, in order
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # asyncio's default on Unix
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # the IPv4 address has its own
            sock.bind((address[0], port, *address[2:]))
            sock.listen(128)  # open at once, as before: connections wait in the backlog until served
            port = sock.getsockname()[1]
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets
