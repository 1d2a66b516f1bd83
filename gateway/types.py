"""Canonical request and response types: the OpenAI chat shape, Weir's lingua franca.

Inbound Anthropic Messages requests are translated into these, every provider adapter translates
from them, and every response comes back as them. Two deliberate extensions of the OpenAI shape:
`cache_control` on content parts, tools, messages and the request (so Anthropic prompt-cache
breakpoints and automatic caching survive the trip), `usage` held as the normalised `gateway.usage.Usage` (rendered per client API), and
reasoning: `reasoning_content` (the field DeepSeek and vLLM add to the OpenAI shape) plus the signed
blocks Anthropic needs back (`reasoning_blocks`, `reasoning_signature`, `redacted_reasoning`), which
are internal: OpenAI clients never see them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import msgspec

from gateway.usage import Usage

FinishReason = str  # "stop", "length", "tool_calls", "content_filter"; servers may add their own


class Base(msgspec.Struct, omit_defaults=True, kw_only=True):
    pass


# --- request -------------------------------------------------------------------------------------


class TextPart(Base, tag="text", tag_field="type"):
    text: str
    cache_control: dict[str, Any] | None = None


class ImageURL(Base):
    url: str  # https URL or data: URL
    detail: str | None = None


class ImagePart(Base, tag="image_url", tag_field="type"):
    image_url: ImageURL
    cache_control: dict[str, Any] | None = None


class InputAudioPart(Base, tag="input_audio", tag_field="type"):
    input_audio: dict[str, Any]


class FilePart(Base, tag="file", tag_field="type"):
    file: dict[str, Any]  # OpenAI's: `file_data` (a data: URL) and `filename`, or `file_id`
    cache_control: dict[str, Any] | None = None


class RefusalPart(Base, tag="refusal", tag_field="type"):
    refusal: str


ContentPart = TextPart | ImagePart | InputAudioPart | FilePart | RefusalPart


class FunctionCall(Base):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


# `"type": "function"` as a tag, not a defaulted field: omit_defaults would drop a default from every
# body and reply, and OpenAI refuses tools, tool calls and a tool_choice without it (the engine ignored
# such tools). A tag is always written, optional on input, and any other value is refused.
class ToolCall(Base, tag="function", tag_field="type"):
    id: str
    function: FunctionCall


class ReasoningBlock(Base, tag="thinking", tag_field="type"):
    """A model's reasoning as a vendor that signs it returned it (Anthropic's thinking block): the
    signature proves the text is the model's own, and the vendor wants both back unchanged."""

    text: str
    signature: str | None = None  # None (or ""): unsigned reasoning, which no vendor will take back


class RedactedReasoning(Base, tag="redacted_thinking", tag_field="type"):
    """Reasoning the vendor returned only encrypted (Anthropic's redacted_thinking), to be sent back as is."""

    data: str


Reasoning = ReasoningBlock | RedactedReasoning


class Message(Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    cache_control: dict[str, Any] | None = None  # applies to the last block this message becomes
    # A tool result that reports the tool's failure (an Anthropic client's `is_error`); the content is the
    # client's own. Anthropic is sent the flag, Gemini the result as its `error`, and OpenAI, which has
    # no way to say it but words, the content after "Error: ".
    is_error: bool | None = None
    # An assistant turn's reasoning, in order (Anthropic inbound); only vendors that sign reasoning use it.
    reasoning_blocks: list[Reasoning] | None = None
    # An assistant turn's reasoning as text, as OpenAI-compatible clients send it back (DeepSeek and
    # Kimi refuse a thinking-mode tool loop without it).
    reasoning_content: str | None = None
    # An Anthropic client's assistant turn as it sent it, where it holds what the fields above cannot
    # (server tool blocks, `server_tool_use` and `web_search_tool_result`..., and text with citations):
    # sent back to Anthropic as it is, as Anthropic wants its server tools' turns; other vendors get
    # the turn from the fields above (its text, calls and reasoning), without the server tools' blocks.
    # So, too, a tool result's content as an Anthropic client sent it, where it holds a block the
    # content parts cannot say (a client-side tool search's `tool_reference`).
    anthropic_content: list[dict[str, Any]] | None = None
    # Internal, from a Responses client only: the turn's input items that only OpenAI's Responses API
    # can read (its encrypted reasoning, custom tool calls and their outputs, built-in tools' calls),
    # sent there as they came (`gateway.providers.openai_responses`); every other adapter ignores them.
    responses_items: list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text parts joined (images and other parts dropped)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))


class FunctionDefinition(Base):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Base, tag="function", tag_field="type"):
    function: FunctionDefinition
    cache_control: dict[str, Any] | None = None


class AnthropicTool(Base):
    """A tool of Anthropic's own API (a `type` other than `custom`): a server tool that Anthropic runs
    (`web_search_20250305`, `web_fetch_20250910`, `code_execution_20250825`, tool search) or a client
    tool whose schema Anthropic defines (`bash_20250124`, `text_editor_20250728`, `computer_*`), or a
    client tool that Anthropic's tool search loads (`defer_loading`). Only an Anthropic backend can
    take one; it gets `definition` as the client sent it, at `position` among the request's tools (the
    function tools keep their order around it)."""

    position: int
    definition: dict[str, Any]

    @property
    def described(self) -> str:
        """What the tool is, for an error: its type, or a deferred client tool's name."""
        kind = self.definition.get("type")
        if kind is None or kind == "custom":
            return f"`{self.definition.get('name')}` with `defer_loading` (Anthropic's tool search)"
        return f"`{kind}`"


class ToolChoiceFunction(Base):
    name: str


class NamedToolChoice(Base, tag="function", tag_field="type"):
    function: ToolChoiceFunction


class AllowedTool(Base, tag="function", tag_field="type"):
    function: ToolChoiceFunction


class AllowedTools(Base):
    mode: Literal["auto", "required"]
    tools: list[AllowedTool]


class AllowedToolsChoice(Base, tag="allowed_tools", tag_field="type"):
    """OpenAI's `{"type": "allowed_tools", ...}`: the model may call only these of `tools`. Resolved
    when the request is built (`ChatRequest.__post_init__`) into the subset of `tools` and the mode,
    which every backend understands, so adapters never see it."""

    allowed_tools: AllowedTools


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice


class JSONSchemaFormat(Base):
    name: str
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(Base):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StreamOptions(Base):
    include_usage: bool | None = None
    # vLLM's and SGLang's: the usage so far on every chunk. Forwarded to OpenAI-compatible servers but
    # OpenAI's own API, which refuses it.
    continuous_usage_stats: bool | None = None
    # OpenAI's: false leaves out the `obfuscation` padding of each chunk (bandwidth over the defence
    # against length side channels). Sent as the client set it: OpenAI's chunks reach OpenAI clients
    # as they came, padding included; other backends pad nothing.
    include_obfuscation: bool | None = None


class ChatRequest(Base):
    model: str
    messages: list[Message]
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    # Anthropic's, Gemini's and vLLM's top-k sampling; OpenAI's own API has none (not sent there).
    top_k: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    seed: int | None = None
    n: int | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    reasoning_effort: str | None = None
    # `reasoning_effort` is another vendor's client's (an Anthropic client's `output_config.effort`),
    # not an OpenAI client's own: sent to OpenAI's models only where they take one, as a budget is.
    reasoning_effort_translated: bool | None = None
    # Tokens the model may spend reasoning (Anthropic's `thinking.budget_tokens`); each provider maps
    # it, or `reasoning_effort` when this is unset, to what its vendor takes.
    reasoning_budget: int | None = None
    # The model decides how much to reason (Anthropic's adaptive thinking), within `reasoning_effort`
    # when one is set; each provider maps it (Gemini: a dynamic thinking budget).
    reasoning_adaptive: bool | None = None
    service_tier: str | None = None
    store: bool | None = None
    # vLLM's: the final assistant message is an unfinished answer to go on writing (what an Anthropic
    # prefill means; a resumed stream sets it). Each provider asks its vendor in the way that vendor
    # continues an answer (`gateway.providers.base.continued`).
    continue_final_message: bool | None = None
    # An Anthropic client's `anthropic-beta` flags (1M context, interleaved thinking...), sent to
    # Anthropic backends only, beside their own; other vendors have no such switch and ignore them.
    anthropic_beta: list[str] | None = None
    # An Anthropic client's tools of Anthropic's own API (`AnthropicTool`), beside its function tools in
    # `tools`: an Anthropic backend takes them; any other vendor's adapter refuses the request
    # (`gateway.providers.base.refuse_anthropic_tools`), so that candidate is skipped.
    anthropic_tools: list[AnthropicTool] | None = None
    # Anthropic's automatic prompt caching (a Messages request's top-level `cache_control`): Claude puts
    # the breakpoint on the last cacheable block itself. Sent to Anthropic backends only; OpenAI and
    # Gemini cache prompts on their own.
    cache_control: dict[str, Any] | None = None
    # Internal, from a Responses client only: its Responses-only settings as it sent them (`tools` with
    # custom and built-in ones, `tool_choice`, `include`, `reasoning.summary`,
    # `prompt_cache_key`), for OpenAI's Responses API (`gateway.providers.openai_responses`). Other
    # adapters refuse built-in tools (`gateway.providers.base.refuse_builtin_tools`) and ignore the rest.
    responses: dict[str, Any] | None = None
    # Top-level parameters Weir does not model; forwarded verbatim to OpenAI-compatible backends only.
    extra: dict[str, Any] = {}

    def __post_init__(self) -> None:
        if self.continue_final_message and not continuable(self.messages):
            raise ValueError(
                "continue_final_message: the final message must be an assistant message with text"
            )
        choice = self.tool_choice
        if isinstance(choice, AllowedToolsChoice):
            # ValueError: msgspec reports it as a validation error of the request (a 400).
            allowed = {tool.function.name for tool in choice.allowed_tools.tools}
            tools = [tool for tool in self.tools or () if tool.function.name in allowed]
            if not tools:
                raise ValueError("tool_choice.allowed_tools names no function of `tools`")
            self.tools, self.tool_choice = tools, choice.allowed_tools.mode

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def continuable(messages: list[Message]) -> bool:
    """Whether the conversation ends with an answer to go on writing: an assistant message with text."""
    last = messages[-1] if messages else None
    return last is not None and last.role == "assistant" and not last.tool_calls and bool(last.text())


# A Responses client's tool types that every backend serves, and so are in `ChatRequest.tools` too
# (custom ones as functions of one string); any other type is one of OpenAI's built-in tools.
_SERVED_EVERYWHERE = ("function", "custom")


def builtin_tools(request: ChatRequest) -> list[tuple[int, dict[str, Any]]]:
    """The OpenAI built-in tools (web_search, local_shell, ...) a Responses client gave, each by its
    place in its `tools` and as it sent it: only OpenAI's Responses API runs them, and none of them is
    in `request.tools` (function and custom tools are, and are not among these)."""
    if not request.responses:  # every request but a Responses client's
        return []
    tools = enumerate(request.responses.get("tools") or ())
    return [
        (i, tool)
        for i, tool in tools
        if isinstance(tool, dict) and tool.get("type") not in _SERVED_EVERYWHERE
    ]


def has_cache_control(request: ChatRequest) -> bool:
    """Whether `request` asks for automatic caching (its own `cache_control`) or any message, part or
    tool of it carries a `cache_control` breakpoint: every one an Anthropic backend is sent, those in
    what a message keeps as its client sent it (`anthropic_content`: server tools' blocks, a tool
    result's `tool_reference`) and on tools of Anthropic's own API (`anthropic_tools`) included."""
    if request.cache_control is not None:
        return True
    for message in request.messages:
        if message.cache_control is not None or _marked(message.anthropic_content):
            return True
        if isinstance(message.content, list) and any(
            getattr(part, "cache_control", None) is not None for part in message.content
        ):
            return True
    if any(tool.cache_control is not None for tool in request.tools or ()):
        return True
    return _marked([tool.definition for tool in request.anthropic_tools or ()])


def block_breakpoints(blocks: Any) -> Iterator[tuple[list[Any], int]]:
    """The `cache_control` breakpoints among blocks in Anthropic's own form (content blocks, tool
    definitions), in the order of the prompt, each as (the list holding its block, the block's
    index): a tool result's own blocks' included, before the result's own marker, which ends it."""
    for i, block in enumerate(blocks if isinstance(blocks, list) else ()):
        if not isinstance(block, dict):
            continue
        if block.get("type") == "tool_result":
            yield from block_breakpoints(block.get("content"))
        if block.get("cache_control") is not None:
            yield blocks, i


def _marked(blocks: Any) -> bool:
    return next(block_breakpoints(blocks), None) is not None


# --- response ------------------------------------------------------------------------------------


class AssistantMessage(Base):
    # No default: omit_defaults would drop a defaulted role, and clients expect it in every message.
    role: Literal["assistant"]
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None
    reasoning_content: str | None = None  # the reasoning text, all blocks joined
    reasoning_blocks: list[Reasoning] | None = None  # internal: the blocks with their signatures
    # OpenAI's annotations of the text as its chat API gives them (`url_citation`s of a search model,
    # OpenRouter's web plugin): OpenAI clients get them as they came, Responses clients as
    # `output_text.annotations` (`gateway.responses_inbound`).
    annotations: list[dict[str, Any]] | None = None
    # Internal: Claude's content blocks as it sent them, where they hold what the fields above cannot
    # (its server tools' `server_tool_use` and `*_tool_result` blocks, text with citations): an
    # Anthropic client gets them as they came, in their order. The fields above still hold the text.
    anthropic_content: list[dict[str, Any]] | None = None
    # Fields of an OpenAI-compatible backend's message Weir does not model (`audio`...):
    # rendered back to OpenAI clients only; other client shapes have no place for them.
    extra: dict[str, Any] = {}


class Choice(Base):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason | None = None
    logprobs: dict[str, Any] | None = None
    # Internal, never rendered to OpenAI clients: which of the request's stop sequences ended the
    # answer, where the backend says (Anthropic), for an Anthropic client's `stop_sequence`.
    stop_sequence: str | None = None
    # Internal, as stop_sequence: Claude's own stop_reason where finish_reason cannot say it
    # (`pause_turn`, `model_context_window_exceeded`), for an Anthropic client.
    anthropic_stop_reason: str | None = None
    # Internal, as stop_sequence: the output items as OpenAI's Responses API returned them (custom tool
    # calls, encrypted reasoning, summaries, built-in tools' calls), for a Responses client as they came.
    responses_output: list[dict[str, Any]] | None = None
    extra: dict[str, Any] = {}  # as AssistantMessage.extra: vLLM's `stop_reason`, `token_ids`...


class ChatResponse(Base):
    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage = Usage()
    system_fingerprint: str | None = None
    extra: dict[str, Any] = {}  # as AssistantMessage.extra: `service_tier`...


class FunctionCallDelta(Base):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Base):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class Delta(Base):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    refusal: str | None = None
    reasoning_content: str | None = None
    # As AssistantMessage.annotations, streamed (a search model's come after its text, alone).
    annotations: list[dict[str, Any]] | None = None
    # Internal, never rendered to OpenAI clients: the signature that ends the reasoning block streamed
    # so far (the next reasoning text starts a new block), and a whole redacted block's data.
    reasoning_signature: str | None = None
    redacted_reasoning: str | None = None
    # Internal, as AssistantMessage.anthropic_content streamed: a content block Claude started that the
    # fields above cannot say (a server tool's block, or a text block of an answer that holds them,
    # which starts a block of its own), and a delta of it they cannot say (a server tool's
    # `input_json_delta`, a `citations_delta`), for an Anthropic client, as they came.
    anthropic_block: dict[str, Any] | None = None
    anthropic_delta: dict[str, Any] | None = None
    extra: dict[str, Any] = {}  # as AssistantMessage.extra, for a chunk Weir re-encodes (`ChatChunk.raw`)

    def carries_output(self) -> bool:
        """Whether this delta holds any of the answer (text, a tool call, a refusal, reasoning, a
        server tool's block), not only the role a stream announces first (with an empty `content`,
        as OpenAI sends it)."""
        if self.content or self.tool_calls or self.refusal:
            return True
        if self.anthropic_block is not None or self.anthropic_delta is not None:
            return True
        return bool(self.reasoning_content or self.reasoning_signature) or self.redacted_reasoning is not None


class ChunkChoice(Base):
    index: int
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: dict[str, Any] | None = None
    stop_sequence: str | None = None  # internal, as Choice.stop_sequence
    anthropic_stop_reason: str | None = None  # internal, as Choice.anthropic_stop_reason
    extra: dict[str, Any] = {}  # as Delta.extra: vLLM's `stop_reason`, `token_ids`...


class ChatChunk(Base):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None  # set on the one chunk that reports usage
    system_fingerprint: str | None = None
    # Internal, never rendered to OpenAI clients: the prompt's tokens as the vendor counted them before
    # answering (Anthropic's message_start, Gemini's first usageMetadata), on the stream's first chunk,
    # for an Anthropic client's message_start. Never billed: accounting reads `usage` alone.
    prompt_usage: Usage | None = None
    # The upstream's own JSON when it says just what this chunk does, in the OpenAI shape
    # (OpenAI-compatible backends): OpenAI clients get it as is, without re-encoding, and with the
    # fields Weir does not model. A chunk changed after decoding is no longer that JSON: `edited`.
    raw: str | None = None
    # Internal, as `raw` for Responses clients: the Responses API event this chunk was read from, for a
    # Responses client as it came (`gateway.responses_inbound`); set only when the client is one.
    responses_event: dict[str, Any] | None = None
    # The fields Weir does not model (vLLM's `prompt_token_ids`...), for OpenAI clients of a chunk that
    # is re-encoded (no `raw`); its choices and their deltas keep theirs likewise.
    extra: dict[str, Any] = {}


def edited(chunk: ChatChunk, **changes: Any) -> ChatChunk:
    """`chunk` with `changes`, without its `raw` JSON or its Responses event, which clients would
    otherwise get in place of the changed chunk."""
    return msgspec.structs.replace(chunk, raw=None, responses_event=None, **changes)


class RawResult(Base):
    """A response Weir passes through as it is, except for its usage (legacy /completions)."""

    data: dict[str, Any]
    usage: Usage | None = None


def is_answer(chunk: object) -> bool:
    """Whether a streamed chunk holds some of the answer (text, a tool call, a refusal, reasoning, a
    finish): more than the role some vendors announce before generating anything (OpenAI's role
    chunk, Anthropic's `message_start`), an empty text or a usage report alone. A stream's first one
    is its first token, which TTFT times and `ttft_timeout` waits for; a stream that ends with none is
    no answer (its decoder fails it). Any other reader's chunk counts."""
    if isinstance(chunk, RawResult):  # a legacy completion's: some text, or a finish
        choices = chunk.data.get("choices") or ()
        return any(isinstance(c, dict) and (c.get("text") or c.get("finish_reason")) for c in choices)
    if not isinstance(chunk, ChatChunk):
        return True
    return any(choice.finish_reason or choice.delta.carries_output() for choice in chunk.choices)


def streams_reasoning(chunk: object) -> bool:
    """Whether a streamed chunk holds reasoning text: a vendor that streams its reasoning (DeepSeek's
    reasoner, Claude's thinking) sends it after the first token, where one that hides it (OpenAI's
    reasoning models, Gemini's thoughts) generated it before (`routing.stats`: what decode speed is
    timed over)."""
    return isinstance(chunk, ChatChunk) and any(choice.delta.reasoning_content for choice in chunk.choices)


def is_output(chunk: object) -> bool:
    """Whether a streamed chunk is more than the role announcement: some of the answer, or the usage
    report."""
    return is_answer(chunk) or (isinstance(chunk, ChatChunk) and chunk.usage is not None)


# --- completions and embeddings ------------------------------------------------------------------


class CompletionRequest(Base):
    model: str
    prompt: str | list[Any]  # text, texts, token ids or lists of token ids
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    user: str | None = None
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    extra: dict[str, Any] = {}


class EmbeddingRequest(Base):
    model: str
    input: str | list[Any]  # text, texts, token ids or lists of token ids
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    user: str | None = None
    extra: dict[str, Any] = {}


class Embedding(Base):
    index: int
    embedding: list[float] | str  # str when encoding_format is base64
    object: str = "embedding"


class EmbeddingResponse(Base):
    data: list[Embedding]
    model: str
    usage: Usage = Usage()


class TokenCount(Base):
    """How many input tokens a chat request would cost on a backend (Anthropic's count_tokens).
    Counting is free: `usage` stays empty, so the attempt's ledger row is priced at zero."""

    input_tokens: int
    usage: Usage = Usage()
