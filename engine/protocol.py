"""The OpenAI protocol as the engine server speaks it, with vLLM's `/tokenize` and `/detokenize`:
request bodies and the error shape.

Request bodies are msgspec Structs: decoding validates types and ranges in one pass, and a failure
names the offending parameter (`$.temperature` -> `temperature`).

Unknown fields are ignored, as OpenAI-compatible servers do, so clients sending newer parameters still
work; parameters that would change the result and that the engine cannot honour are rejected by the
server instead (see `unsupported`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

Probability = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0.0, le=2.0)]
Count = Annotated[int, msgspec.Meta(ge=0)]
# A chat completion must write at least one token (OpenAI, vLLM and Weir's gateway answer 0 with a 400
# naming the parameter); only a legacy completion takes 0, to score its echoed prompt.
AtLeastOne = Annotated[int, msgspec.Meta(ge=1)]
# choices per request: each is a sequence in the engine's batch, so the cap keeps one request from
# filling it (OpenAI allows 128). More is the engine's limit, not the client's mistake: refused as a
# value the engine does not take (`unsupported`), which a gateway passes on to its next candidate.
MAX_CHOICES = 16
Choices = Annotated[int, msgspec.Meta(ge=1)]
Bias = Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]
TopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=20)]
Stop = str | list[str] | None
# A 64-bit signed seed, as vLLM takes it: torch seeds a generator with up to 64 unsigned bits, and choice
# i of n draws with seed + i, which this range keeps inside them (larger seeds were a 400 naming nothing,
# "Overflow when unpacking long long", for some n and not others).
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class SamplingFields(msgspec.Struct, kw_only=True):
    """Parameters shared by both endpoints, including vLLM's extras."""

    model: str
    temperature: Temperature | None = None
    top_p: Probability | None = None
    n: Choices = 1
    seed: Seed | None = None
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Bias] | None = None  # token id (as a string, as JSON keys are) -> bias
    user: str | None = None
    # vLLM-style extras
    top_k: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    min_p: Probability | None = None
    repetition_penalty: RepetitionPenalty | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    guided_json: str | dict[str, Any] | None = None  # a JSON Schema (vLLM's older structured output)
    # OpenAI's (chat); vLLM takes it on legacy completions too, where ignoring it gave free text
    response_format: dict[str, Any] | None = None
    min_tokens: Count = 0  # EOS and stop tokens banned, stop strings ignored, until this many tokens
    # vLLM extras that change the output and that the engine does not implement: declared so that a
    # request setting one gets a 400 naming it (see `unsupported`) instead of a silently different answer
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    use_beam_search: bool = False
    truncate_prompt_tokens: Any = None
    prompt_logprobs: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_tokens: AtLeastOne | None = None
    max_completion_tokens: AtLeastOne | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: the final (assistant) message is an unfinished answer the model goes on writing, with
    # no end of its turn and no new one opened (a prefill, or a gateway resuming a broken stream).
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    # OpenAI's, decoded only to be refused (`unsupported`): the engine answers in text, searches
    # nothing, and ignoring them would hand back another answer than the one asked for.
    modalities: list[str] | None = None
    web_search_options: dict[str, Any] | None = None
    echo: bool = False  # vLLM's: the reply starts with the final message's text (not implemented)


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[Any]  # a string, token ids, or a batch of either (checked by the server)
    max_tokens: Count | None = None  # None: the legacy default of 16, capped by the context
    echo: bool = False
    logprobs: TopLogprobs | None = None
    best_of: int | None = None
    suffix: str | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's `/tokenize`: exactly one of a completion `prompt` or chat `messages` (checked by the
    server), tokenized as the completions or chat completions endpoint would."""

    model: str
    prompt: str | None = None
    add_special_tokens: bool = True
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "none": tools are not used, as in a chat completion
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str
    tokens: list[int]


# --- errors -------------------------------------------------------------------------------------------

_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    """An error a client sees, in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.type = type or _ERROR_TYPES.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def param_of(error: msgspec.ValidationError) -> str | None:
    """`Expected int - at `$.messages[0].role`` -> `messages[0].role`."""
    message = str(error)
    marker = "at `$."
    if marker not in message:
        return None
    return message.split(marker, 1)[1].split("`", 1)[0]


# OpenAI's codes for a parameter, or a value of one, that this model does not take: a gateway in front
# passes such a 400 over to its next candidate (a vendor that takes images or tools answers), where any
# other 400 is the client's mistake and ends the request.
UNSUPPORTED_PARAMETER = "unsupported_parameter"
UNSUPPORTED_VALUE = "unsupported_value"


# OpenAI's words (vLLM refuses it too): options of a stream for an answer that is not streamed.
STREAM_OPTIONS_WITHOUT_STREAM = "The 'stream_options' parameter is only allowed when 'stream' is enabled."


def unsupported(req: ChatCompletionRequest | CompletionRequest) -> ApiError | None:
    """A parameter the engine cannot honour, or one it cannot take with another, as the 400 that
    says so, or None."""
    if req.stream_options is not None and not req.stream:
        return ApiError(400, STREAM_OPTIONS_WITHOUT_STREAM, param="stream_options")
    if req.n > MAX_CHOICES:
        return ApiError(400, f"n above {MAX_CHOICES} is not supported", param="n", code=UNSUPPORTED_VALUE)
    unhonoured = [
        ("use_beam_search", req.use_beam_search),
        *(
            (name, getattr(req, name) is not None)
            for name in (
                "guided_regex",
                "guided_choice",
                "guided_grammar",
                "structured_outputs",
                "truncate_prompt_tokens",
                "prompt_logprobs",
                "allowed_token_ids",
                "bad_words",
            )
        ),
    ]
    for name, used in unhonoured:
        if used:
            hint = " (use echo with logprobs)" if name == "prompt_logprobs" else ""
            return ApiError(400, f"{name} is not supported{hint}", param=name, code=UNSUPPORTED_PARAMETER)
    fmt = (req.response_format or {}).get("type", "text")
    if fmt not in ("text", "json_object", "json_schema"):
        return ApiError(
            400,
            f"response_format {fmt!r} is not supported",
            param="response_format",
            code=UNSUPPORTED_VALUE,
        )
    if isinstance(req, CompletionRequest):
        if req.best_of not in (None, 1, req.n):
            return ApiError(
                400, "best_of must equal n (choices are not ranked)", param="best_of", code=UNSUPPORTED_VALUE
            )
        if req.suffix:
            return ApiError(400, "suffix is not supported", param="suffix", code=UNSUPPORTED_PARAMETER)
    else:
        if req.modalities and "audio" in req.modalities:
            return ApiError(400, "audio output is not supported", param="modalities", code=UNSUPPORTED_VALUE)
        if req.web_search_options is not None:
            return ApiError(
                400,
                "web search is not supported",
                param="web_search_options",
                code=UNSUPPORTED_PARAMETER,
            )
        if req.echo:
            return ApiError(400, "echo is not supported", param="echo", code=UNSUPPORTED_PARAMETER)
        if req.top_logprobs and not req.logprobs:
            return ApiError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    return None
