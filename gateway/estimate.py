"""What an attempt that ended without a usage report still cost: an estimate to bill instead of zero.

Vendors report usage only in a stream's last chunk. When the client goes away (or the upstream
breaks) before it, the backend has still produced, and billed, the tokens that reached the gateway.
The gateway cancels the upstream at once (draining it would pay for tokens nobody reads) and bills
an estimate, marked `estimated` in the usage event and the ledger:

- prompt: the upstream request body at 4 bytes per token, and what a chat template adds to its
  messages (`template_tokens`), the same rule admission uses to reserve budget and routing uses for
  the prompt's length (an over-estimate by the JSON framing: the tenant pays at most a little more,
  never zero), except that an image, document or audio clip sent inline
  (base64) counts at most about what its vendor bills for an image, not its size, and one sent by URL
  (which its vendor fetches and bills as it bills one sent inline) that much, not its URL's size,
  and so does one referenced by id, uploaded before (`prompt_tokens`);
- output: the larger of the count of chunks that carried text (OpenAI-compatible servers send about
  one token per chunk) and the generated text at 4 bytes per token (vendors that batch tokens).

A whole (non-streamed) answer whose body was not read to its end (its attempt cancelled once its
status line came, or its body broke off, went silent past the backend's read timeout or ran past the
gateway's size cap) was generated in full: the prompt as above, and the output from the body's size
less its vendor's envelope (`whole_answer`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import msgspec

from gateway.types import ChatChunk, ChatRequest, Message, ReasoningBlock, builtin_tools
from gateway.usage import Usage

BYTES_PER_TOKEN = 4


def _ceil_tokens(size: int) -> int:
    return -(-size // BYTES_PER_TOKEN)


# What a part sent inline (an image, a PDF, an audio clip as base64) is estimated to cost, at most, and
# what one sent by URL is estimated to cost (its size is not known):
# vendors bill an image by its pixels, not its bytes, and a photo's base64 is hundreds of kB (at 4
# bytes a token, 150,000 tokens for 600 kB). Without decoding it, one allowance that covers a
# typical image at every vendor: Anthropic scales an image down to about 1.15 megapixels (1568 px on
# its long edge) and bills width * height / 750, about 1,600 tokens at most; OpenAI's high detail
# bills 85 + 170 per 512 px tile of the image fit in 2048 px and scaled to 768 px on its short side,
# 765 tokens for a square image, 1,105 for a 3:2 photo; Gemini bills 258 per 768 px tile. Low for a
# many-page PDF, long audio or a model that takes larger images; the vendor's report replaces it
# wherever one comes.
INLINE_PART_TOKENS = 1600

# What a request body holds if it carries a part inline, in every vendor's form: a string that starts
# with a data URL (OpenAI's `image_url` and `file` parts, the Responses API's `input_image` and
# `input_file`) or a `data` field (Anthropic's base64 `source`, Gemini's `inlineData`, OpenAI's
# `input_audio`); or by URL: a URL's `://` (OpenAI's `image_url`, Anthropic's `url` source, Gemini's
# `fileData`); or by id, a file uploaded before: a `file_id` (OpenAI's `file` part, the Responses
# API's `input_file` and `input_image`, Anthropic's `file` source). A body with none of them (nearly
# every one) is not parsed: a scan of its bytes for each costs about as much as parsing it, and
# walking the parsed body far more.
_MEDIA_MARKERS = (b'"data', b"://", b'"file_id"')
_DATA_URL_KEYS = frozenset(("url", "image_url", "file_data"))
_INLINE_DATA_KEYS = frozenset(("inlineData", "inline_data", "input_audio"))
_FILE_DATA_KEYS = frozenset(("fileData", "file_data"))


# What a chat template writes besides the messages' text, which their JSON does not hold. Per message,
# the markers around its turn: OpenAI documents 3 a message (`<|start|>{role}<|message|>...<|end|>`),
# ChatML (SmolLM2's, Qwen's) writes 5 (`<|im_start|>{role}\n...<|im_end|>\n`) and Llama 3 about as
# many; the lower figure, since the message's own JSON framing (`{"role":"user","content":""}`, 7
# tokens at 4 bytes a token) already stands for most of them. Per chat, the reply's priming (3:
# ChatML's `<|im_start|>assistant\n`, OpenAI's `<|start|>assistant<|message|>`) and the system turn a
# template writes when the chat sends none: 22 tokens in SmolLM2's, the bundled engine's model, and
# about 20 in Qwen 2.5's and in Llama 3.1's dated system header. Without them a short chat was
# estimated at about half its length ("What is the capital of France?": 17 tokens, 37 to SmolLM2),
# and the room for output left in a context window was too large for the backend to accept.
MESSAGE_TOKENS = 3
CHAT_TOKENS = 3 + 22

# A message's role as a body writes it, in every vendor's form (OpenAI's and Anthropic's `messages`,
# Gemini's `contents`, the Responses API's `input` items): a `role` key whose value names a role those
# APIs take. Not a tool schema's property named `role` (an object), nor the word in a text (its quotes
# escaped: `\"role\"`), nor a tool call's argument so named (Anthropic's `input` and Gemini's `args`
# are objects) unless its value is a role's name. Counting every `"role"` key, a tool schema with a
# `role` property added a message's MESSAGE_TOKENS to every request that sent it. One pass over the
# bytes, about as fast as that count (the body is not parsed: `prompt_tokens` runs on every upstream
# request).
_MESSAGE_ROLE = re.compile(rb'"role"\s*:\s*"(?:user|assistant|system|developer|tool|function|model)"')


def template_tokens(body: bytes) -> int:
    """The tokens a chat template adds to a request body's messages (CHAT_TOKENS, and MESSAGE_TOKENS
    for each message); none for a body without messages (a completion's prompt, embeddings' input),
    which no template wraps."""
    messages = len(_MESSAGE_ROLE.findall(body))
    return CHAT_TOKENS + MESSAGE_TOKENS * messages if messages else 0


def prompt_tokens(body: bytes) -> int:
    """An upstream request's prompt tokens from its body: its size at 4 bytes per token (coarse, high
    by the JSON framing, never zero), each part sent inline counted as its size or INLINE_PART_TOKENS,
    whichever is less, and each sent by URL or by file id as INLINE_PART_TOKENS, and what a chat
    template adds (`template_tokens`). What admission reserves, what an attempt cut before its usage
    report bills, and (`input_tokens`) the prompt's length to routing."""
    return _content_tokens(body) + template_tokens(body)


def _content_tokens(body: bytes) -> int:
    """A body's tokens at 4 bytes per token, its parts sent inline, by URL or by file id as above."""
    if not any(marker in body for marker in _MEDIA_MARKERS):
        return _ceil_tokens(len(body))
    try:
        tree = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return _ceil_tokens(len(body))
    media = list(_media_parts(tree))
    return _ceil_tokens(len(body) - sum(size for size, _ in media)) + sum(cost for _, cost in media)


def _inline(size: int) -> tuple[int, int]:
    """A part sent inline, `size` bytes of base64 or data URL: those bytes, and what they are billed."""
    return size, min(_ceil_tokens(size), INLINE_PART_TOKENS)


def _by_url(value: Any) -> tuple[int, int] | None:
    """A part sent by the URL `value`, if it is one (a data URL is inline): its bytes, and its cost."""
    if isinstance(value, str) and "://" in value[:64] and not value.startswith("data:"):
        return len(value), INLINE_PART_TOKENS
    return None


def _by_id(node: dict[str, Any]) -> tuple[int, int] | None:
    """A part sent as the id of a file uploaded before, if `node` is one: its vendor reads the file and
    bills it as the same part sent inline, whose size the id does not tell, so one allowance, as for a
    URL. Not when the part carries the file inline too (counted as that)."""
    file_id = node.get("file_id")
    if isinstance(file_id, str) and file_id and "file_data" not in node and "data" not in node:
        return len(file_id), INLINE_PART_TOKENS
    return None


def _media_parts(tree: Any) -> Iterator[tuple[int, int]]:
    """Each part sent inline, by URL or by file id in a decoded request body: the bytes of the body it
    takes (its base64, its data URL, its URL, its id), and the tokens it is estimated at instead."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        data = node.get("data")
        if node.get("type") == "base64" and isinstance(data, str):  # Anthropic's source
            yield _inline(len(data))
        if (part := _by_id(node)) is not None:
            yield part
        for key, value in node.items():
            if isinstance(value, str):
                if key in _DATA_URL_KEYS and value.startswith("data:") and ";base64," in value[:256]:
                    yield _inline(len(value))
                elif key == "image_url" and (part := _by_url(value)) is not None:
                    yield part  # the Responses API's input_image
            elif not isinstance(value, dict | list):
                continue
            elif key in _INLINE_DATA_KEYS and isinstance(value, dict) and isinstance(value.get("data"), str):
                yield _inline(len(value["data"]))  # Gemini's inline data, OpenAI's input audio
            elif isinstance(value, dict) and (part := _linked(key, value)) is not None:
                yield part
            else:
                stack.append(value)


def _linked(key: str, value: dict[str, Any]) -> tuple[int, int] | None:
    """The part sent by URL that the object `value` under `key` is, if it is one: OpenAI's `image_url`
    (`{"url": ...}`), Anthropic's `source` of type `url`, Gemini's `fileData` (`fileUri`)."""
    if key == "image_url":
        return _by_url(value.get("url"))
    if key == "source" and value.get("type") == "url":
        return _by_url(value.get("url"))
    if key in _FILE_DATA_KEYS:
        return _by_url(value.get("fileUri", value.get("file_uri")))
    return None


def input_tokens(request: ChatRequest) -> int:
    """A chat's input tokens from what would be sent (messages and tools as JSON), by the same rule
    (`prompt_tokens`: the chat template's tokens included). For count_tokens where no backend can
    count, and the prompt's length to routing (`routing.plan.features`: route conditions,
    context-window fit, expected cost). Tools of the client's own API that `tools` does not hold count
    as the definitions their vendor is sent and bills as input: Anthropic's (`anthropic_tools`: a
    server tool, a client tool loaded by tool search; a tool is in them or in `tools`, never both,
    `gateway.anthropic_inbound`) and a Responses client's OpenAI built-in tools (`builtin_tools`: web
    search, file search, MCP...; its function and custom tools are in `tools`, and not among them)."""
    messages = [_once(m) for m in request.messages]
    own = [tool.definition for tool in request.anthropic_tools or ()]
    own += [tool for _, tool in builtin_tools(request)]
    return prompt_tokens(msgspec.json.encode([messages, request.tools or [], own]))


def _once(message: Message) -> Message:
    """`message` with each of its blocks once. A message that keeps what its client sent as sent, for
    the vendor of that client's API (which is sent that in its place), holds its text, calls and parts
    twice: there, and in the canonical fields every other backend is sent. Counted twice, a tool
    call's arguments or a tool result's text was twice its length to context-window fit and route
    conditions. Which backend it goes to is not known yet (routing reads this), so it is counted from
    what it keeps as sent, the larger of the two (the rest, and what that API alone reads: server
    tools' results, OpenAI's encrypted reasoning), and the canonical fields it duplicates are left out:
    - `anthropic_content` (an Anthropic client's turn with server tools' blocks, a tool result with a
      `tool_reference`) holds the turn's reasoning too: all four go;
    - `responses_items` (a Responses client's turn with OpenAI's encrypted reasoning, custom tool
      calls or their outputs, built-in tools' calls) holds none of the reasoning Weir handed out (its
      text, its signatures: OpenAI's encrypted reasoning alone is among them), which the turn's
      `reasoning_content` and `reasoning_blocks` still count, once (`_reasoning_once`)."""
    if message.anthropic_content is not None:
        return msgspec.structs.replace(
            message, content=None, tool_calls=None, reasoning_blocks=None, reasoning_content=None
        )
    if message.responses_items is not None:
        message = msgspec.structs.replace(message, content=None, tool_calls=None)
    return _reasoning_once(message)


def _reasoning_once(message: Message) -> Message:
    """`message` with its reasoning text once. A turn can carry it twice: as `reasoning_content`, what
    OpenAI-compatible backends are sent, and in its signed thinking blocks (`reasoning_blocks`), what
    Claude is sent (a Responses client's turn with the reasoning Weir signed holds both). Each backend
    gets one of them: the larger text counts, and the blocks' signatures and redacted data beside it."""
    blocks, text = message.reasoning_blocks, message.reasoning_content
    if not blocks or text is None:
        return message
    signed = sum(len(block.text) for block in blocks if isinstance(block, ReasoningBlock))
    if signed > len(text):
        return msgspec.structs.replace(message, reasoning_content=None)
    bare = [
        msgspec.structs.replace(block, text="") if isinstance(block, ReasoningBlock) else block
        for block in blocks
    ]
    return msgspec.structs.replace(message, reasoning_blocks=bare)


def chunk_text_bytes(chunk: Any) -> int:
    """UTF-8 bytes of generated text (content, refusal, reasoning, tool-call names and arguments) in
    a chunk: reasoning is output the vendor bills too."""
    if isinstance(chunk, ChatChunk):
        size = 0
        for choice in chunk.choices:
            delta = choice.delta
            size += len((delta.content or "").encode()) + len((delta.refusal or "").encode())
            size += len((delta.reasoning_content or "").encode())
            for call in delta.tool_calls or ():
                if call.function is not None:
                    size += len((call.function.name or "").encode())
                    size += len((call.function.arguments or "").encode())
        return size
    data = getattr(chunk, "data", None)  # a passed-through legacy /completions chunk
    if isinstance(data, dict):
        return sum(
            len(str(choice.get("text") or "").encode())
            for choice in data.get("choices") or ()
            if isinstance(choice, dict)
        )
    return 0


def with_thinking(usage: Usage, thought_bytes: int) -> Usage:
    """An answer's usage with its reasoning tokens where its vendor reported none: a Claude answer
    (before `output_tokens_details`, and on models without it, Anthropic bills thinking inside
    `output_tokens` and says nothing of its share), or a stream cut before any usage report
    (`Produced.estimate`). Estimated from the thinking received (reasoning text and redacted blocks'
    data, `thought_bytes`) at BYTES_PER_TOKEN, at most `output_tokens`, and marked
    `reasoning_estimated`; low where Claude 4 returns a summary of a longer thinking it bills in
    full, and 0 where the reasoning is hidden (OpenAI's). A breakdown for reports and routing
    (`cheapest`, `lowest_latency`), never what is billed."""
    if usage.reasoning_tokens or not thought_bytes:
        return usage
    estimate = min(_ceil_tokens(thought_bytes), usage.output_tokens)
    return msgspec.structs.replace(usage, reasoning_tokens=estimate, reasoning_estimated=estimate > 0)


class Produced:
    """Counts what a stream generated so far, to estimate its output if no usage report comes."""

    __slots__ = ("chunks", "text_bytes", "thought_bytes")

    def __init__(self) -> None:
        self.chunks = 0
        self.text_bytes = 0
        self.thought_bytes = 0  # the reasoning received, to estimate its share (`with_thinking`)

    def add(self, chunk: Any) -> None:
        size = chunk_text_bytes(chunk)
        if size:
            self.chunks += 1
            self.text_bytes += size
        if isinstance(chunk, ChatChunk):
            self.thought_bytes += sum(_thought_bytes(choice.delta) for choice in chunk.choices)

    def estimate(self, request_body: bytes) -> Usage:
        """The usage to bill for a stream cut before the vendor reported any, at the service tier the
        request asked for where it named one (`asked_tier`): a flex stream billed at the base price
        cost twice what its vendor charged. Its reasoning share is estimated from the reasoning
        received, as a Claude answer's is (`with_thinking`): a stream cut mid-thinking reasoned."""
        return self.with_output(
            Usage(input_tokens=prompt_tokens(request_body), service_tier=asked_tier(request_body))
        )

    def with_output(self, usage: Usage) -> Usage:
        """`usage` with the output estimated from what was generated so far, its reasoning share too."""
        output = max(self.chunks, _ceil_tokens(self.text_bytes))
        return with_thinking(msgspec.structs.replace(usage, output_tokens=output), self.thought_bytes)


def _thought_bytes(delta: Any) -> int:
    """The reasoning a delta carries: its text, or a redacted block's encrypted data (as the Anthropic
    adapter counts it for `with_thinking`)."""
    return len((delta.reasoning_content or "").encode()) + len((delta.redacted_reasoning or "").encode())


# The service tiers a request can name and be served at as asked (OpenAI's flex and priority
# processing, which its vendor reports back): `auto` leaves the tier to the vendor (Scale Tier or
# Priority capacity where the project has some), `default` and Anthropic's `standard_only` are the
# base price, so none of them tells what an attempt is billed.
CONCRETE_TIERS = frozenset(("flex", "priority"))


class _ServiceTier(msgspec.Struct):
    service_tier: Any = None


_service_tier = msgspec.json.Decoder(_ServiceTier)


def asked_tier(body: bytes) -> str | None:
    """The concrete service tier (CONCRETE_TIERS) an upstream request body asks its vendor for, or
    None: what admission reserves a request's budget at, and what an attempt without its vendor's
    usage report is billed at. The upstream body, not the client's: an OpenAI client's `priority`
    asks Anthropic for `auto`, which need not be served at Priority Tier."""
    if b'"service_tier"' not in body:  # nearly every request: no parse
        return None
    try:
        tier = _service_tier.decode(body).service_tier
    except msgspec.MsgspecError:
        return None
    return tier if isinstance(tier, str) and tier in CONCRETE_TIERS else None


# Web searches admission reserves for a request whose web search tool sets no `max_uses`. Anthropic
# then caps the searches with nothing but its server-side loop, which pauses the turn (`pause_turn`)
# after 10 iterations, each normally one search: about 10 per request, the client's continuation
# being a request of its own (reserved anew). Claude Code sends `max_uses: 8`.
DEFAULT_WEB_SEARCH_ESTIMATE = 10
# Anthropic's web search tool types are `web_search_` and a date (`web_search_20250305`); OpenAI's
# `web_search`, `web_search_preview` and `web_search_2025_08_26` are none of them, and are billed on
# no `web_search_requests` count Weir reads.
_WEB_SEARCH_PREFIX = "web_search_"


class _Tool(msgspec.Struct):
    type: Any = None
    max_uses: Any = None


class _Tools(msgspec.Struct):
    tools: list[_Tool] | None = None


_tools = msgspec.json.Decoder(_Tools)


def _is_web_search(kind: Any) -> bool:
    return (
        isinstance(kind, str)
        and kind.startswith(_WEB_SEARCH_PREFIX)
        and kind[len(_WEB_SEARCH_PREFIX) :].isdigit()
    )


def web_search_estimate(body: bytes) -> int:
    """The web searches to reserve for an upstream request: each Anthropic web search tool's
    `max_uses`, DEFAULT_WEB_SEARCH_ESTIMATE without one; 0 without such a tool. What admission
    reserves at the model's `web_search` price beside the tokens; settlement bills the searches run."""
    if b'"web_search_' not in body:  # nearly every request: no parse
        return 0
    try:
        tools = _tools.decode(body).tools or ()
    except msgspec.MsgspecError:
        return 0
    return sum(
        tool.max_uses if type(tool.max_uses) is int and tool.max_uses >= 0 else DEFAULT_WEB_SEARCH_ESTIMATE
        for tool in tools
        if _is_web_search(tool.type)
    )


# Tokens admission reserves for a request that sets no output limit (`output_estimate`), and what an
# answer whose size nothing tells is billed then (`whole_answer`).
DEFAULT_OUTPUT_ESTIMATE = 1024


class _GenerationConfig(msgspec.Struct):
    maxOutputTokens: int | None = None
    candidateCount: int | None = None


class _OutputLimit(msgspec.Struct):
    """The output cap and the number of choices as each vendor's request body spells them; every other
    field is skipped."""

    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    max_output_tokens: int | None = None
    n: int | None = None
    generationConfig: _GenerationConfig | None = None
    # A legacy completion's: the candidates generated per prompt (`best_of`, billed each) and its
    # prompts (a list of texts or of token-id lists: `n` answers, or `best_of` candidates, for each).
    best_of: int | None = None
    prompt: Any = None  # Any: a Responses body's `prompt` is an object


_output_limit = msgspec.json.Decoder(_OutputLimit)


def completion_choices(n: int | None, best_of: int | None, prompt: Any) -> int:
    """The choices a legacy completion generates, each billed: `best_of` (at least `n`) for each of
    its prompts (a text or a list of token ids is one; a list of texts or of id lists, one each)."""
    prompts = 1
    if isinstance(prompt, list) and prompt and not all(type(v) is int for v in prompt):
        prompts = len(prompt)
    return max(n or 1, best_of or 1, 1) * prompts


def _cap_and_choices(body: bytes) -> tuple[int | None, int]:
    """An upstream request's output cap per choice (None: it sets none, or its body is unreadable) and
    the choices it asks for (`n`, Gemini's `candidateCount`; a legacy completion's `best_of` for each
    of its prompts, `completion_choices`): every choice is billed."""
    try:
        found = _output_limit.decode(body)
    except msgspec.MsgspecError:
        return None, 1
    config = found.generationConfig
    nested = config.maxOutputTokens if config else None
    cap = found.max_completion_tokens or found.max_tokens or found.max_output_tokens or nested
    if config is not None and config.candidateCount:
        return cap, max(config.candidateCount, 1)
    return cap, completion_choices(found.n, found.best_of, found.prompt)


def output_estimate(body: bytes) -> int:
    """The output tokens to reserve for an upstream request: its cap (DEFAULT_OUTPUT_ESTIMATE without
    one) for each choice it asks for."""
    cap, choices = _cap_and_choices(body)
    return (cap or DEFAULT_OUTPUT_ESTIMATE) * choices


def whole_answer(request_body: bytes, answer_bytes: int | None, envelope_bytes: int) -> Usage:
    """The usage to bill for a whole answer its vendor generated and the gateway did not read to its
    end: the prompt as for a stream; the output from `answer_bytes`, the answer's size (or the least
    it is known to be), less `envelope_bytes`, what its vendor's answer holds besides the text (ids,
    model, usage...: the size of one with no text), at 4 bytes per token, never below 0 and never
    above the output the request allowed (its cap for every choice). With no size at all
    (`answer_bytes` None: a chunked answer none of which came), the output the request allowed, as
    admission reserved it (`output_estimate`): with a cap, the most its vendor can bill for it."""
    if answer_bytes is None:
        output = output_estimate(request_body)
    else:
        output = _ceil_tokens(max(0, answer_bytes - envelope_bytes))
        cap, choices = _cap_and_choices(request_body)
        if cap is not None:
            output = min(output, cap * choices)
    tier = asked_tier(request_body)  # as for a stream (`Produced.estimate`)
    return Usage(input_tokens=prompt_tokens(request_body), output_tokens=output, service_tier=tier)
