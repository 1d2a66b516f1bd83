"""Google Gemini (generativelanguage API, v1beta) as a backend: canonical chat <-> generateContent /
streamGenerateContent?alt=sse, and embeddings through batchEmbedContents. Reasoning asked for (a
budget or an effort) sets `thinkingConfig` with `includeThoughts`; thought parts come back as
`reasoning_content`. Function calls' thought signatures travel in the tool call ids (see
`gateway.providers.base.call_id_with_signature`), as do the ids Gemini gives its calls (`_issued_id`)."""

from __future__ import annotations

import math
import re
from collections import ChainMap
from collections.abc import Callable, Mapping
from typing import Any, Literal
from urllib.parse import quote

import msgspec

from gateway.config import Backend
from gateway.errors import BadGateway, GatewayError, InvalidRequest
from gateway.providers.base import (
    NO_THINKING,
    Continuation,
    Param,
    ParamTable,
    Provider,
    UpstreamRequest,
    VendorApi,
    as_list,
    call_id_with_signature,
    check_stop_count,
    continued,
    decode_json,
    error_text,
    guess_media_type,
    json_encode,
    json_instruction,
    new_id,
    now,
    parse_arguments,
    parse_data_url,
    parse_image_data_url,
    refuse_anthropic_tools,
    refuse_builtin_tools,
    refuse_emptied_final_turn,
    refuse_unexpressible,
    split_call_id,
    token_count,
    unexpressible,
    upstream_error,
)
from gateway.types import (
    AssistantMessage,
    ChatChunk,
    ChatRequest,
    ChatResponse,
    Choice,
    ChunkChoice,
    ContentPart,
    Delta,
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    FilePart,
    FunctionCall,
    FunctionCallDelta,
    ImagePart,
    InputAudioPart,
    Message,
    NamedToolChoice,
    TextPart,
    TokenCount,
    ToolCall,
    ToolCallDelta,
)
from gateway.usage import Usage, normalise_usage

VENDOR = "gemini"

FINISH_REASONS = {
    "STOP": "stop",
    "MAX_TOKENS": "length",
    "SAFETY": "content_filter",
    "RECITATION": "content_filter",
    "BLOCKLIST": "content_filter",
    "PROHIBITED_CONTENT": "content_filter",
    "SPII": "content_filter",
    "IMAGE_SAFETY": "content_filter",
    "IMAGE_PROHIBITED_CONTENT": "content_filter",
    "IMAGE_RECITATION": "content_filter",
    "LANGUAGE": "content_filter",  # stopped for a language Gemini does not serve: refused, not finished
}

PARAMS = ParamTable(
    {
        "temperature": Param("generationConfig.temperature"),
        "top_p": Param("generationConfig.topP"),
        "top_k": Param("generationConfig.topK"),
        "stop": Param("generationConfig.stopSequences", as_list),
        "n": Param("generationConfig.candidateCount"),
        "seed": Param("generationConfig.seed"),
        # 0, what many clients send by default, asks for nothing: left out.
        "presence_penalty": Param("generationConfig.presencePenalty", lambda penalty: penalty or None),
        "frequency_penalty": Param("generationConfig.frequencyPenalty", lambda penalty: penalty or None),
    }
)

# reasoning_effort -> thinkingBudget, as Google maps it on its own OpenAI-compatible endpoint
# ("none" turns thinking off where the model allows it; "minimal" gets the smallest budget).
EFFORT_BUDGETS = {"none": 0, "minimal": 1024, "low": 1024, "medium": 8192, "high": 24576}
EFFORT_BUDGETS |= {"xhigh": 24576, "max": 24576}  # Anthropic's efforts above high: Flash's top budget
DYNAMIC = -1  # thinkingBudget -1: the model decides how much to think
# The thinkingBudget each Gemini 2.5 model takes, as Google documents it: least, most, and whether 0
# stops its thinking. A budget outside is its 400 ("The thinking budget 31999 is invalid. Please
# choose a value between 0 and 24576.": an Anthropic client's large budget), and 2.5 Pro, which cannot
# stop thinking, refuses 0 ("Budget 0 is invalid. This model only works in thinking mode.").
_BUDGET_RANGES = (
    (re.compile(r"gemini-2\.5-pro"), 128, 32768, False),
    (re.compile(r"gemini-2\.5-flash-lite"), 512, 24576, True),
    (re.compile(r"gemini-2\.5-flash"), 1, 24576, True),
)


def _budget_for(model: str, budget: int) -> int:
    """A thinking budget as the model takes it: within its range (the nearest it takes; no thinking on
    2.5 Pro, its least), the dynamic -1 as it is. Models the table does not know get it unchanged."""
    for pattern, least, most, stops in _BUDGET_RANGES:
        if pattern.search(model):
            if budget == DYNAMIC or (budget == 0 and stops):
                return budget
            return min(max(budget, least), most)
    return budget


# The fields of Gemini's `Schema` (a subset of OpenAPI 3.0's schema object, parsed as a proto message),
# for function parameters and response schemas alike. Any other keyword is a 400 for the whole request
# ('Invalid JSON payload received. Unknown name "const" at ...: Cannot find field.'): JSON Schema's
# ways of saying what these say are translated (`_as_gemini`), the rest (`additionalProperties`,
# `$schema`, `exclusiveMinimum`, `uniqueItems`...: checks Gemini cannot make) left out.
_SCHEMA_FIELDS = frozenset(
    {
        *("type", "format", "title", "description", "nullable", "enum", "default", "example"),
        *("properties", "required", "minProperties", "maxProperties", "propertyOrdering"),
        *("items", "minItems", "maxItems", "minLength", "maxLength", "pattern", "minimum", "maximum"),
        "anyOf",
    }
)
# Keywords whose value is a schema, or a list of schemas; `properties` maps names to schemas. Only these
# are cleaned: elsewhere (a property's name, an enum value, a default) the unsupported words are data.
_SUBSCHEMA_KEYS = frozenset({"items", "anyOf", "oneOf", "allOf"})
_LOCAL_REFS = ("#/$defs/", "#/definitions/")
# Inlining copies a definition per reference: a few nested definitions each referring twice to the
# next would multiply without end. Past this much copying (keys and items of the copied nodes) a
# reference is an object of any shape. The budget is a request's, shared by all its schemas, and
# counts copies only (the schemas' own nodes are bounded by the body's size): one per schema, a request of thousands of tools, each a kilobyte of
# such definitions, grew to gigabytes and held the event loop for minutes.
_MAX_INLINED_NODES = 20_000  # keys and items


def clean_schema(schema: Any, cleaner: SchemaCleaner | None = None) -> Any:
    """A JSON schema as Gemini's OpenAPI subset takes it: the keywords it rejects left out, and local
    `$ref`s inlined, since it has no `$defs` (Pydantic puts every nested model there: dropped, their
    references dangled and the model answered a string where an object belonged). A reference back
    into its own definition cannot be inlined: it becomes an object of any shape. `cleaner`: the
    request's, whose node budget every schema of the request draws on."""
    return (cleaner or SchemaCleaner()).clean(schema, ChainMap(), ())


class SchemaCleaner:
    def __init__(self) -> None:
        self.left = _MAX_INLINED_NODES

    def clean(self, schema: Any, defs: ChainMap[str, Any], seen: tuple[str, ...]) -> Any:
        if not isinstance(schema, dict):
            return schema
        if seen:  # inside an inlined definition: a copy, charged for what it iterates
            self.left -= len(schema) + sum(len(v) for v in schema.values() if isinstance(v, dict | list))
        for key in ("definitions", "$defs"):
            if isinstance(found := schema.get(key), dict):
                # Chained, not merged: a copy of a definition that holds many definitions copied them
                # all again for each reference to it.
                defs = defs.new_child(found)
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith(_LOCAL_REFS):
            name = ref.split("/", 2)[2]
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            if name in seen or not isinstance(defs.get(name), dict) or self.left <= 0:
                return {"type": "object", **self.clean(rest, defs, seen)}
            return self.clean({**defs[name], **rest}, defs, (*seen, name))
        out: dict[str, Any] = {}
        for key, value in schema.items():
            if key == "properties" and isinstance(value, dict):
                out[key] = {name: self.clean(sub, defs, seen) for name, sub in value.items()}
            elif key in _SUBSCHEMA_KEYS and isinstance(value, list):
                out[key] = [self.clean(item, defs, seen) for item in value]
            elif key in _SUBSCHEMA_KEYS:
                out[key] = self.clean(value, defs, seen)
            elif key in _SCHEMA_FIELDS or key == "const":
                out[key] = value
        return _as_gemini(out)


def _as_gemini(schema: dict[str, Any]) -> dict[str, Any]:
    """A cleaned schema node's JSON Schema keywords in Gemini's terms: `allOf` merged in (every one
    holds), `oneOf` as `anyOf` (Gemini cannot check "exactly one"), `const` as an enum of one, a
    `null` among the types (`["string", "null"]`, as OpenAI documents optional fields in strict mode,
    or Pydantic's `anyOf` of a type and `null`) as `nullable`, and enums as Gemini takes them
    (`_enum_as_gemini`). Sent as they came, each was Gemini's 400."""
    for part in schema.pop("allOf", None) or ():
        if isinstance(part, dict):
            _merge_into(schema, part)
    one_of = schema.pop("oneOf", None)
    if isinstance(one_of, list) and "anyOf" not in schema:
        schema["anyOf"] = one_of
    if "const" in schema:
        schema.setdefault("enum", [schema.pop("const")])
    kinds = schema.get("type")
    if isinstance(kinds, list):
        named = [kind for kind in kinds if kind != "null"]
        if len(named) < len(kinds):
            schema["nullable"] = True
        del schema["type"]
        if len(named) == 1:
            schema["type"] = named[0]
        elif named:
            schema.setdefault("anyOf", [{"type": kind} for kind in named])
    _enum_as_gemini(schema)
    if isinstance(schema.get("properties"), dict):
        # Gemini takes `properties` on an OBJECT alone ("only allowed for OBJECT type"), and never
        # empty ("should be non-empty for OBJECT type": a Pydantic model without fields, a tool's
        # action that takes no arguments): JSON Schema's implicit object made explicit, an empty
        # object left as one of any shape.
        if "type" not in schema and "anyOf" not in schema:
            schema["type"] = "object"
        if not schema["properties"] or str(schema.get("type", "object")).lower() != "object":
            del schema["properties"]  # a string's properties (MCP tools' slips) say nothing either
    if str(schema.get("type")).lower() == "array" and "items" not in schema:
        # Gemini refuses an array without `items` ("items: missing field"): an array of anything is
        # asked for as one of strings, an answer the client's schema takes.
        schema["items"] = {"type": "string"}
    if isinstance(schema.get("required"), list):
        # Gemini refuses a required name that `properties` does not define ("property is not defined",
        # MCP tools' slips): what no property says cannot be asked for.
        defined = schema.get("properties") or {}
        schema["required"] = [name for name in schema["required"] if name in defined]
        if not schema["required"]:
            del schema["required"]
    variants = schema.get("anyOf")
    if isinstance(variants, list) and any(_is_null(v) for v in variants):
        schema["nullable"] = True
        variants = schema.pop("anyOf")
        named = [v for v in variants if not _is_null(v)]
        if len(named) == 1 and isinstance(named[0], dict):
            schema = {**named[0], **schema}  # Optional[X]: X, its description and default the outer's
        elif named:
            schema["anyOf"] = named
    return schema


def _enum_as_gemini(schema: dict[str, Any]) -> None:
    """Gemini's `enum` is a STRING's alone ("enum: only allowed for STRING type") and holds strings:
    a null among the values is `nullable` (OpenAI's strict optional enum), an untyped enum of strings
    a STRING's, and another type's values (Pydantic's `Literal[1, 2]`) are told in the description,
    where the model still reads them, the type kept so that the answer parses as the client's."""
    values = schema.get("enum")
    if not isinstance(values, list):
        return
    if None in values:
        schema["nullable"] = True
        values = [value for value in values if value is not None]
    strings = bool(values) and all(isinstance(value, str) for value in values)
    if "type" not in schema and strings:
        schema["type"] = "string"
    if strings and str(schema["type"]).lower() == "string":
        schema["enum"] = values
        return
    del schema["enum"]
    if values:
        note = f"One of: {json_encode(values).decode()}"
        schema["description"] = f"{schema['description']}\n\n{note}" if schema.get("description") else note


def _is_null(schema: Any) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "null"


def _merge_into(schema: dict[str, Any], part: dict[str, Any]) -> None:
    """One of `allOf`'s schemas into the schema holding it: its properties and required names added,
    any other keyword where the schema has none of its own."""
    for key, value in part.items():
        if key == "properties" and isinstance(value, dict):
            schema["properties"] = {**value, **(schema.get("properties") or {})}
        elif key == "required" and isinstance(value, list):
            schema["required"] = list(dict.fromkeys([*(schema.get("required") or []), *value]))
        else:
            schema.setdefault(key, value)


# The backend's key in `x-goog-api-key`, on the model list (`/v1beta/models`) as on every request.
API = VendorApi(key_header="x-goog-api-key", root="/v1beta")


def _url(backend: Backend, model: str, method: str, query: dict[str, str] | None = None) -> str:
    return API.url(backend, f"/models/{quote(model, safe='')}:{method}", query)


# The image types Gemini reads; any other (a GIF, which OpenAI and Claude take) is its 400
# ("Unsupported MIME type: image/gif").
IMAGE_TYPES = ("image/png", "image/jpeg", "image/webp", "image/heic", "image/heif")


def _check_image_type(kind: str, where: str) -> None:
    """A 400 `unsupported_value` for an image Gemini cannot read, before anything is sent: a route
    passes the candidate over for one that reads it, and a client of Gemini alone is told why."""
    if kind not in IMAGE_TYPES:
        raise InvalidRequest(
            f"{where}: images of type {kind} are not supported by Gemini models, which read "
            f"{', '.join(IMAGE_TYPES)}",
            param=where,
            code="unsupported_value",
        )


# The audio Gemini reads inline, by OpenAI's `input_audio.format` (OpenAI's own are wav and mp3):
# Google documents these MIME types for audio understanding.
AUDIO_FORMATS = ("wav", "mp3", "aiff", "aac", "ogg", "flac")


def _audio(audio: dict[str, Any], where: str) -> dict[str, Any]:
    """An OpenAI `input_audio` part (base64 `data` and a `format`) as Gemini's inline audio; a format
    it does not read is a 400 `unsupported_value` before anything is sent, as an image's is."""
    kind, data = audio.get("format"), audio.get("data")
    if not isinstance(data, str) or not data:
        raise InvalidRequest(
            f"{where}.input_audio.data: base64 audio is required", param=f"{where}.input_audio.data"
        )
    if kind not in AUDIO_FORMATS:
        raise InvalidRequest(
            f"{where}.input_audio.format: audio of format {kind!r} is not supported by Gemini models, "
            f"which read {', '.join(AUDIO_FORMATS)}",
            param=f"{where}.input_audio.format",
            code="unsupported_value",
        )
    return {"inlineData": {"mimeType": f"audio/{kind}", "data": data}}


def _parts(content: str | list[ContentPart] | None, where: str) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"text": content}] if content else []
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        if isinstance(part, TextPart):
            if part.text:  # Gemini refuses an empty text part
                parts.append({"text": part.text})
        elif isinstance(part, ImagePart):
            data = parse_image_data_url(part.image_url.url)
            kind = data[0] if data is not None else guess_media_type(part.image_url.url)
            _check_image_type(kind, f"{where}.content[{i}]")
            if data is not None:
                parts.append({"inlineData": {"mimeType": kind, "data": data[1]}})
            else:
                parts.append({"fileData": {"mimeType": kind, "fileUri": part.image_url.url}})
        elif isinstance(part, FilePart) and (inline := parse_data_url(str(part.file.get("file_data", "")))):
            parts.append({"inlineData": {"mimeType": inline[0], "data": inline[1]}})  # a PDF, say
        elif isinstance(part, InputAudioPart):
            parts.append(_audio(part.input_audio, f"{where}.content[{i}]"))
        else:
            raise InvalidRequest(
                f"content parts of type '{type(part).__struct_config__.tag}' are not supported by Gemini models",
                param=f"{where}.content[{i}]",
            )
    return parts


def _function_response(message: Message) -> dict[str, Any]:
    text = message.text()
    try:
        value = msgspec.json.decode(text) if text else {}
    except (msgspec.DecodeError, RecursionError):
        value = text
    if message.is_error:
        # Gemini's documented key for a function's failure (the whole response is its output without
        # one): the client's result as it sent it, said to be an error.
        return {"error": value}
    # Gemini wants an object; anything else is wrapped.
    return value if isinstance(value, dict) else {"result": value}


# Gemini (3 on) gives each function call an `id`, and matches the functionResponse that answers it by
# that id, which alone tells parallel calls to one function apart. Weir hands the id out as the tool
# call's, marked, so that it goes back (on the call and on its result) only where Gemini issued it:
# another vendor's id, or one Weir made for a call Gemini gave none, is never sent as Gemini's.
_ISSUED_MARK = "__gid"


def _tool_call_id(issued: Any) -> str:
    """The tool call id Weir hands out for a functionCall whose `id` is `issued` (None: it had none)."""
    return f"{issued}{_ISSUED_MARK}" if isinstance(issued, str) and issued else new_id("call_")


def _issued_id(call_id: str) -> str | None:
    """The functionCall `id` Gemini issued for this tool call id, or None where Gemini issued none."""
    base = split_call_id(call_id)[0]
    issued = base.removesuffix(_ISSUED_MARK)
    return issued if issued and issued != base else None


def _contents(messages: list[Message], model: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    system: list[dict[str, Any]] = []
    contents: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}  # tool call id -> function name (Gemini answers by name)
    # A functionResponse's `response` is JSON only. Gemini 3 takes a tool result's images inside it
    # (`parts`, its multimodal function responses); earlier models have no such field, and are shown
    # them as parts of the user turn, after the turn's function responses.
    nested_media = is_gemini_3(model)
    media: list[dict[str, Any]] = []

    def append(role: str, parts: list[dict[str, Any]]) -> None:
        # Gemini refuses a content without parts (an assistant turn of content "", a stored empty
        # reply): it is left out, its neighbours of one role joined as any two turns of one role are.
        if not parts:
            return
        if contents and contents[-1]["role"] == role:
            contents[-1]["parts"].extend(parts)
        else:
            contents.append({"role": role, "parts": parts})

    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if media and message.role != "tool":
            append("user", media)
            media = []
        if message.role in ("system", "developer"):
            system.extend(_parts(message.content, where))
        elif message.role == "user":
            append("user", _parts(message.content, where))
        elif message.role == "assistant":
            parts = _parts(message.content, where)
            for j, call in enumerate(message.tool_calls or ()):
                call_names[call.id] = call.function.name
                args = parse_arguments(call.function.arguments, f"{where}.tool_calls[{j}].function.arguments")
                function_call: dict[str, Any] = {"name": call.function.name, "args": args}
                if (issued := _issued_id(call.id)) is not None:
                    function_call["id"] = issued
                part: dict[str, Any] = {"functionCall": function_call}
                signature = split_call_id(call.id)[1]
                if signature is not None:
                    part["thoughtSignature"] = signature
                parts.append(part)
            append("model", parts)
        else:
            if not message.tool_call_id:
                raise InvalidRequest("tool messages need a tool_call_id", param=f"{where}.tool_call_id")
            name = call_names.get(message.tool_call_id) or message.name
            if name is None:
                raise InvalidRequest(
                    f"no earlier assistant tool call has id {message.tool_call_id!r}",
                    param=f"{where}.tool_call_id",
                )
            response: dict[str, Any] = {"name": name, "response": _function_response(message)}
            if (issued := _issued_id(message.tool_call_id)) is not None:
                response["id"] = issued
            images = [part for part in _parts(message.content, where) if "text" not in part]
            if images and nested_media:
                response["parts"] = images
            else:
                media.extend(images)
            append("user", [{"functionResponse": response}])
    if media:
        append("user", media)
    refuse_emptied_final_turn(messages, contents, "Gemini")
    return system, contents


# Google's documented stand-in for a signature Weir does not have (calls made by another vendor, or by
# a client that dropped the id): Gemini 3 then skips the check instead of refusing the request.
UNSIGNED = "skip_thought_signature_validator"
_BEFORE_3 = re.compile(r"gemini-[12]\b")
# Gemini continues a trailing model turn (a prefill) up to 3.1; 3.5 Flash-Lite and 3.6 on refuse one
# ("Requests ending with a model turn are not supported"). Models this does not know are taken to be
# newer.
_PREFILL = re.compile(r"gemini-(1\.|2\.|3-|3\.1-)")


def is_gemini_3(model: str) -> bool:
    """Gemini 3 and later (and the `-latest` aliases, which point there): signed function calls and
    thinking levels. Gemini 1 and 2, and Gemma, have neither."""
    return "gemini" in model and not _BEFORE_3.search(model)


def _sign_current_turn(contents: list[dict[str, Any]], model: str) -> None:
    """Gemini 3 checks the first function call of each model step since the last user text."""
    if not is_gemini_3(model):
        return  # Gemini 1 and 2 (and Gemma) check nothing, and are not sent a stand-in they may not know
    for content in reversed(contents):
        if content["role"] == "user" and any("text" in part for part in content["parts"]):
            return
        if content["role"] != "model":
            continue
        calls = [part for part in content["parts"] if "functionCall" in part]
        if calls and not any("thoughtSignature" in part for part in calls):
            calls[0]["thoughtSignature"] = UNSIGNED


def _tool_config(request: ChatRequest) -> dict[str, Any] | None:
    choice = request.tool_choice
    if choice is None:
        return None
    if choice == "auto":
        config: dict[str, Any] = {"mode": "AUTO"}
    elif choice == "required":
        config = {"mode": "ANY"}
    elif choice == "none":
        config = {"mode": "NONE"}
    elif isinstance(choice, NamedToolChoice):
        config = {"mode": "ANY", "allowedFunctionNames": [choice.function.name]}
    else:  # allowed_tools never gets here: ChatRequest resolves it into tools and a mode
        return None
    return {"functionCallingConfig": config}


def thinking_levels(model: str) -> tuple[str, ...]:
    """The `thinkingLevel`s a Gemini 3 model takes, least first: every one takes low and high, the
    Flash models minimal and medium too (3 Pro refuses those with a 400)."""
    return ("minimal", "low", "medium", "high") if "flash" in model else ("low", "high")


# Models that do not think (Gemini 1.5 and 2.0 but 2.0 Flash Thinking, Gemma, served by the same API):
# any `thinkingConfig` is their 400 ("thinking_config is not supported."), one that asks for no
# thinking (budget 0) included.
_NO_THINKING_MODEL = re.compile(r"gemini-1\.|gemini-2\.0-(?!flash-thinking)|\bgemma-")


def _unthinking(request: ChatRequest, model: str) -> None:
    """What a model that does not think is asked about reasoning: nothing. An Anthropic client's
    thinking (a budget, adaptive, an effort) is a preference that client sends every turn, kept by
    models that think, as OpenAI's non-reasoning models are sent none; an effort of none or minimal
    asks for what the model does anyway. An OpenAI client's own effort above those asks this model
    for reasoning it has not: a 400 naming it, before anything is sent (a route passes the candidate
    over), instead of Gemini's 400 about a field the client never sent."""
    effort = request.reasoning_effort
    if effort is None or request.reasoning_effort_translated or effort in NO_THINKING:
        return
    raise InvalidRequest(
        f"'reasoning_effort' is not supported by {model}: the model does not reason",
        param="reasoning_effort",
        code="unsupported_parameter",
    )


def _thinking_config(request: ChatRequest, model: str) -> dict[str, Any] | None:
    if _NO_THINKING_MODEL.search(model):
        _unthinking(request, model)
        return None
    effort, budget = request.reasoning_effort, request.reasoning_budget
    if is_gemini_3(model) and (budget is None or budget == 0):
        # Gemini 3 thinks in levels and cannot stop thinking (a budget of 0 is a 400 on 3 Pro): an
        # effort becomes the level of that name, or the next one up that the model takes.
        levels = thinking_levels(model)
        if budget == 0 or effort in NO_THINKING:
            return {"thinkingLevel": levels[0]}  # the least there is; its thoughts are not asked for
        if effort in EFFORT_BUDGETS:
            level = effort if effort in levels else "high"  # 3 Pro's medium is high
            return {"thinkingLevel": level, "includeThoughts": True}
        return {"includeThoughts": True} if request.reasoning_adaptive else None
    if budget is None and effort is not None:
        budget = EFFORT_BUDGETS.get(effort)
    if budget is None and request.reasoning_adaptive:
        budget = DYNAMIC  # the model decides, as Anthropic's adaptive thinking
    if budget is None:
        return None  # the model's default: it may think, and its thoughts are not returned
    config: dict[str, Any] = {"thinkingBudget": _budget_for(model, budget)}
    if budget != 0:
        config["includeThoughts"] = True  # reasoning asked for is shown, as reasoning_content
    return config


MAX_STOP_SEQUENCES = 5  # generationConfig.stopSequences: "up to 5"
# What generateContent as Weir asks it cannot carry, which left out would change the answer: biased or
# banned tokens (OpenAI's token ids mean nothing to Gemini's tokenizer), a spoken answer (Weir sends
# no `responseModalities`), a web search (Weir sends no `googleSearch` tool). `user`, `store`,
# `metadata`, `service_tier`, `prediction`, `verbosity` and the prompt-cache hints are left out
# instead: they ask for no other answer.
UNEXPRESSIBLE = unexpressible("logit_bias", "modalities", "web_search_options")
# Repetition penalties, which only Gemini 2.0 takes: later models (and ids this table does not know,
# taken to be newer) refuse one other than 0 with a 400 no route fails over from ("Penalty is not
# enabled for models/gemini-2.5-flash").
_PENALTIES = re.compile(r"gemini-2\.0-")
PENALTIES = unexpressible("frequency_penalty", "presence_penalty")


def chat_body(request: ChatRequest, model: str) -> dict[str, Any]:
    # Tools first, then parameters, as on every adapter; here, not in `chat_request` alone, so that a
    # count (`count_tokens_request`) is refused where the request it counts would be, not made without
    # the tools that request could not carry.
    refuse_anthropic_tools(request, "Gemini")
    refuse_builtin_tools(request, "Gemini models")
    check_stop_count(request, MAX_STOP_SEQUENCES, "Gemini")
    refuse_unexpressible(request, UNEXPRESSIBLE, "Gemini models")
    if not _PENALTIES.search(model):
        refuse_unexpressible(request, PENALTIES, "Gemini models after 2.0")
    system, contents = _contents(request.messages, model)
    _sign_current_turn(contents, model)
    body: dict[str, Any] = {"contents": contents}
    if system:
        body["systemInstruction"] = {"parts": system}
    PARAMS.apply(request, body)
    if request.output_limit is not None:
        body.setdefault("generationConfig", {})["maxOutputTokens"] = request.output_limit
    thinking = _thinking_config(request, model)
    if thinking is not None:
        body.setdefault("generationConfig", {})["thinkingConfig"] = thinking
    if request.logprobs:
        config = body.setdefault("generationConfig", {})
        config["responseLogprobs"] = True
        if request.top_logprobs:  # alternatives a step; OpenAI's 0 is Gemini's leaving it out
            config["logprobs"] = request.top_logprobs
    cleaner = SchemaCleaner()  # one node budget for every schema of the request
    if request.tools:
        declarations = []
        for tool in request.tools:
            declaration: dict[str, Any] = {"name": tool.function.name}
            if tool.function.description:
                declaration["description"] = tool.function.description
            if tool.function.parameters and tool.function.parameters.get("properties"):
                declaration["parameters"] = clean_schema(tool.function.parameters, cleaner)
            declarations.append(declaration)
        body["tools"] = [{"functionDeclarations": declarations}]
    tool_config = _tool_config(request)
    if tool_config is not None and request.tools:
        body["toolConfig"] = tool_config
    form = request.response_format
    if form is not None and form.type != "text" and request.tools and not is_gemini_3(model):
        # Gemini before 3 refuses a JSON response type beside function declarations ("Function calling
        # with a response mime type: 'application/json' is unsupported"): asked in words instead.
        body.setdefault("systemInstruction", {"parts": []})["parts"].append({"text": json_instruction(form)})
    elif form is not None and form.type != "text":
        config = body.setdefault("generationConfig", {})
        config["responseMimeType"] = "application/json"
        if form.json_schema is not None and form.json_schema.schema:
            config["responseSchema"] = clean_schema(form.json_schema.schema, cleaner)
    if "systemInstruction" in body and _NO_SYSTEM.search(model):
        _fold_system(body)
    return body


# Gemma, served by the same API, takes no system instruction ("Developer instruction is not enabled
# for models/gemma-3-27b-it", a 400 for every request with a system prompt): it has no system role, and
# Google's guidance is to give the instructions at the start of the first user turn.
_NO_SYSTEM = re.compile(r"\bgemma-")


def _fold_system(body: dict[str, Any]) -> None:
    """The system instruction as the first parts of the first user turn (one of its own before a
    conversation that starts with the model's)."""
    parts = body.pop("systemInstruction")["parts"]
    contents = body["contents"]
    if contents and contents[0]["role"] == "user":
        contents[0]["parts"] = [*parts, *contents[0]["parts"]]
    else:
        contents.insert(0, {"role": "user", "parts": parts})


def continuation(backend: Backend, model: str) -> Continuation:
    return backend.continuation or ("prefill" if _PREFILL.search(model) else "instruction")


def chat_request(backend: Backend, request: ChatRequest, model: str) -> UpstreamRequest:
    body = json_encode(chat_body(continued(request, continuation(backend, model)), model))
    if request.stream:
        return UpstreamRequest(
            _url(backend, model, "streamGenerateContent", {"alt": "sse"}),
            API.headers(backend),
            body,
            stream=True,
        )
    return UpstreamRequest(_url(backend, model, "generateContent"), API.headers(backend), body)


def _candidate(
    candidate: dict[str, Any], call_ids: list[str]
) -> tuple[str | None, str | None, list[ToolCall]]:
    """A candidate's text, its thoughts (the reasoning) and its function calls."""
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    for part in (candidate.get("content") or {}).get("parts") or ():
        if "text" in part:
            (thoughts if part.get("thought") else texts).append(part["text"])
        elif "functionCall" in part:
            call = part["functionCall"]
            call_id = call_id_with_signature(_tool_call_id(call.get("id")), part.get("thoughtSignature"))
            call_ids.append(call_id)
            arguments = msgspec.json.encode(call.get("args") or {}).decode()
            calls.append(
                ToolCall(id=call_id, function=FunctionCall(name=call.get("name", ""), arguments=arguments))
            )
    return ("".join(texts) if texts else None), ("".join(thoughts) if thoughts else None), calls


def _token_logprob(item: dict[str, Any]) -> dict[str, Any]:
    token = str(item.get("token") or "")
    # proto3 JSON leaves out a zero: a token the model was certain of comes without logProbability.
    return {
        "token": token,
        "logprob": float(item.get("logProbability") or 0.0),
        "bytes": list(token.encode()),
    }


def _logprobs(candidate: dict[str, Any]) -> dict[str, Any] | None:
    """A candidate's `logprobsResult` as OpenAI's choice `logprobs`: one entry a decoding step, its
    `topCandidates` as the entry's `top_logprobs`. None when the candidate carries none."""
    result = candidate.get("logprobsResult")
    if not isinstance(result, dict):
        return None
    steps = result.get("topCandidates") or []
    content = []
    for i, chosen in enumerate(result.get("chosenCandidates") or ()):
        top = (steps[i].get("candidates") or []) if i < len(steps) else []
        content.append({**_token_logprob(chosen), "top_logprobs": [_token_logprob(t) for t in top]})
    return {"content": content, "refusal": None}


def _finish(reason: str | None, has_calls: bool) -> str | None:
    if reason is None:
        return None
    finish = FINISH_REASONS.get(reason, "stop")
    return "tool_calls" if finish == "stop" and has_calls else finish


# Finish reasons that say the model failed to produce its answer, not that the answer ended: the
# function call it wrote could not be parsed, it called a tool none was offered for or more tools than
# Gemini allows, its response was malformed, or a thought signature was missing from the request.
# Taken as a finish (OpenAI's `stop`) they reached the client as an empty answer; as the backend's
# failure (502) the next candidate, or a retry, answers instead.
_FAILED_FINISH = frozenset(
    {
        "MALFORMED_FUNCTION_CALL",
        "UNEXPECTED_TOOL_CALL",
        "TOO_MANY_TOOL_CALLS",
        "MALFORMED_RESPONSE",
        "MISSING_THOUGHT_SIGNATURE",
    }
)


# Finish reasons that name no reason: Google documents OTHER as "Unknown reason." (Vertex: "All other
# reasons that stopped the token generation"), IMAGE_OTHER as image generation stopped "for a reason not
# otherwise specified", and NO_IMAGE as an image expected and none generated. After some of the answer
# they end it (`stop`: the client has what came); with none of it, text or a tool call, they reached the
# client as an empty `stop`: an answer Gemini failed to give, as the `_FAILED_FINISH` ones are.
_UNKNOWN_FINISH = frozenset({"OTHER", "IMAGE_OTHER", "NO_IMAGE"})


# A STOP before any text or function call (a candidate without parts, or of empty text; its thoughts
# aside) is an answer Gemini failed to give as well: 2.5 Flash-Lite and Pro send it now and then,
# mostly deep in tool loops, and asked again they answer. Taken as a finish it reached the client as
# an empty answer it could not tell from a real one (as LiteLLM passes it on); as the backend's
# failure (502, billed what Google reports) the route fails over, or the client retries. Where the
# request may end with nothing (`_may_be_empty`) it is the answer: a stop sequence the answer began
# with (Gemini says STOP for those too), or an answer being continued that was whole already.


def _may_be_empty(request: ChatRequest) -> bool:
    return bool(request.stop) or bool(request.continue_final_message)


def _check_answered(reason: str | None, answered: bool, data: dict[str, Any], may_be_empty: bool) -> None:
    """A candidate ended for no named reason, or a STOP the request cannot end with empty, before any
    of its answer came: the backend's failure (502, failed over), billed the usage `data` reports as a
    failed finish is."""
    if answered or not (reason in _UNKNOWN_FINISH or (reason == "STOP" and not may_be_empty)):
        return
    raise BadGateway(
        f"the Gemini backend stopped without an answer (finishReason {reason})", billed=_billed(data)
    )


def _check_blocked(data: dict[str, Any]) -> None:
    """A blocked prompt, or an answer Gemini failed to give, as the error the client sees. Both came in
    a 200, which Google bills (only a 4xx or 5xx is free): the error carries the usage reported."""
    feedback = data.get("promptFeedback") or {}
    if feedback.get("blockReason") and not data.get("candidates"):
        raise InvalidRequest(
            f"Gemini blocked the prompt: {feedback['blockReason']}",
            code="content_filter",
            billed=_billed(data),
        )
    for candidate in data.get("candidates") or ():
        reason = candidate.get("finishReason")
        if reason in _FAILED_FINISH:
            raise BadGateway(
                f"the Gemini backend failed to answer (finishReason {reason})", billed=_billed(data)
            )


def _billed(data: dict[str, Any]) -> Usage | None:
    """The usage a response reports, or None where it reports none."""
    return normalise_usage(VENDOR, data["usageMetadata"]) if data.get("usageMetadata") else None


def empty_answer(model: str) -> bytes:
    """A generateContent answer with no text, in the fields every one carries (Gemini's adds token
    details by modality)."""
    candidate = {"content": {"parts": [{"text": ""}], "role": "model"}, "finishReason": "STOP", "index": 0}
    usage = {"promptTokenCount": 0, "candidatesTokenCount": 0, "totalTokenCount": 0}
    return json_encode(
        {"candidates": [candidate], "usageMetadata": usage, "modelVersion": model, "responseId": "0" * 22}
    )


def chat_response_to(request: ChatRequest) -> Callable[[bytes, str], ChatResponse]:
    """How the whole answer to `request` is read: an empty STOP is its answer where it may be one."""
    if not _may_be_empty(request):
        return chat_response
    return lambda body, model: chat_response(body, model, may_be_empty=True)


def chat_response(body: bytes, model: str, *, may_be_empty: bool = False) -> ChatResponse:
    data = decode_json(body, "the Gemini backend")
    if not isinstance(data, dict):
        raise BadGateway("the Gemini backend returned an unexpected response")
    _check_blocked(data)
    if not data.get("candidates"):
        # Neither an answer nor a blocked prompt: a failure to fail over from, never an empty answer.
        raise BadGateway("the Gemini backend returned a response without candidates", billed=_billed(data))
    choices = []
    for i, candidate in enumerate(data.get("candidates") or ()):
        text, thoughts, calls = _candidate(candidate, [])
        _check_answered(candidate.get("finishReason"), bool(text or calls), data, may_be_empty)
        message = AssistantMessage(
            role="assistant",
            content=text if text is not None or not calls else None,
            tool_calls=calls or None,
            reasoning_content=thoughts,
        )
        finish = _finish(candidate.get("finishReason") or "STOP", bool(calls))
        choices.append(
            Choice(
                index=candidate.get("index", i),
                message=message,
                finish_reason=finish,
                logprobs=_logprobs(candidate),
            )
        )
    return ChatResponse(
        id=data.get("responseId") or new_id("chatcmpl-"),
        created=now(),
        model=data.get("modelVersion") or model,
        choices=choices,
        usage=normalise_usage(VENDOR, data.get("usageMetadata")),
    )


class ChatStream:
    """Each SSE event is a whole GenerateContentResponse; usageMetadata is cumulative, the last one counts."""

    def __init__(self, request: ChatRequest, model: str) -> None:
        self.model = model
        self.id = new_id("chatcmpl-")
        self.created = now()
        self.usage: dict[str, Any] | None = None
        self.started: set[int] = set()
        self.tool_calls: dict[int, int] = {}  # candidate index -> tool calls sent so far
        # Gemini has no `parallel_tool_calls` switch: for a client that asked for no parallel calls,
        # a candidate's calls after its first are left out.
        self.most_calls = 1 if request.parallel_tool_calls is False else None
        # Each candidate (`n`, candidateCount) streams and finishes on its own, interleaved with the
        # others: the stream is whole once every one asked for, and every one seen, has finished.
        self.candidates = request.n or 1
        self.answered: set[int] = set()  # candidates some text or a tool call came for
        self.finished: set[int] = set()
        self.prompt_told = False  # the first chunk carried the prompt's count (`ChatChunk.prompt_usage`)
        self.may_be_empty = _may_be_empty(request)

    def feed(self, event: str | None, data: str) -> list[ChatChunk]:
        try:
            payload = msgspec.json.decode(data)
        except msgspec.DecodeError:
            raise BadGateway("the Gemini backend sent an invalid stream event") from None
        if "error" in payload:
            # The same object as in an error body: its status and RetryInfo count as they would there.
            detail = payload["error"] if isinstance(payload["error"], dict) else {}
            code = detail.get("code")
            status = code if isinstance(code, int) and 400 <= code <= 599 else 500
            raise _error(status, str(detail.get("message", "stream error")), detail, {})
        _check_blocked(payload)
        if payload.get("usageMetadata"):
            self.usage = payload["usageMetadata"]
        self.model = payload.get("modelVersion") or self.model
        choices = []
        for i, candidate in enumerate(payload.get("candidates") or ()):
            index = candidate.get("index", i)
            text, thoughts, calls = _candidate(candidate, [])
            if text or calls:
                self.answered.add(index)
            _check_answered(candidate.get("finishReason"), index in self.answered, payload, self.may_be_empty)
            first = self.tool_calls.get(index, 0)
            if self.most_calls is not None:
                calls = calls[: max(self.most_calls - first, 0)]
            deltas = [
                ToolCallDelta(
                    index=first + k,
                    id=call.id,
                    type="function",
                    function=FunctionCallDelta(name=call.function.name, arguments=call.function.arguments),
                )
                for k, call in enumerate(calls)
            ]
            self.tool_calls[index] = first + len(calls)
            role: Literal["assistant"] | None = None if index in self.started else "assistant"
            self.started.add(index)
            finish = _finish(candidate.get("finishReason"), self.tool_calls[index] > 0)
            if finish is not None:
                self.finished.add(index)
            delta = Delta(role=role, content=text, tool_calls=deltas or None, reasoning_content=thoughts)
            logprobs = _logprobs(candidate)
            if logprobs is not None and not logprobs["content"]:
                logprobs = None  # a chunk without tokens (the finish alone): none, as OpenAI sends it
            choices.append(ChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=logprobs))
        if not choices:
            return []
        chunk = ChatChunk(id=self.id, created=self.created, model=self.model, choices=choices)
        counted = self.partial_usage()
        if counted is not None and not self.prompt_told:
            # Every event carries the usage so far: the prompt's count is known from the first.
            chunk.prompt_usage, self.prompt_told = counted.prompt_only(), True
        return [chunk]

    def close(self) -> list[ChatChunk]:
        unfinished = (set(range(self.candidates)) | self.started) - self.finished
        if unfinished:
            raise BadGateway(
                "the Gemini backend ended the stream before a finishReason"
                + (f" for candidates {sorted(unfinished)}" if self.candidates > 1 else "")
            )
        usage = normalise_usage(VENDOR, self.usage)
        return [ChatChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)]

    def partial_usage(self) -> Usage | None:
        """The last usageMetadata before a break (every event carries the usage so far): the prompt
        and its cached part counted exactly (see `gateway.pipeline._cut_usage`)."""
        return normalise_usage(VENDOR, self.usage) if self.usage else None


# Google says when to retry in the error body, never in a header: a google.rpc.RetryInfo among
# `error.details`, whose `retryDelay` is a protobuf Duration in its JSON form ("30s", "0.5s").
_RETRY_INFO = "type.googleapis.com/google.rpc.RetryInfo"
_DURATION = re.compile(r"\d{1,10}(?:\.\d{1,9})?s")
# Google refuses the gateway's API key (wrong, deleted, or expired: "API key expired. Please renew
# the API key." has the same reason) with a 400 INVALID_ARGUMENT, as if the request were at fault;
# a google.rpc.ErrorInfo among `error.details` says `"reason": "API_KEY_INVALID"`.
_ERROR_INFO = "type.googleapis.com/google.rpc.ErrorInfo"
_KEY_REFUSED = "API_KEY_INVALID"
# Google refuses a project it will not serve (the free tier where it is not offered: "Gemini API free
# tier is not available in your country. Please enable billing on your project in Google AI Studio.",
# or "User location is not supported for the API use.") with a 400 FAILED_PRECONDITION: the gateway's
# account, not the request, as a refused key is.
_ACCOUNT_REFUSED = "FAILED_PRECONDITION"


def _detail(error: Mapping[str, Any], kind: str) -> dict[str, Any] | None:
    """The first of an error's `details` of this `@type` (RetryInfo, ErrorInfo), or None."""
    details = error.get("details")
    for item in details if isinstance(details, list) else ():
        if isinstance(item, dict) and item.get("@type") == kind:
            return item
    return None


def retry_hint(detail: Mapping[str, Any]) -> dict[str, str]:
    """An error's RetryInfo as the headers the executor and the clients' SDKs read: `retry-after-ms`
    exactly, `retry-after` in whole seconds rounded up. Empty when it has none (or not a Duration)."""
    delay = (_detail(detail, _RETRY_INFO) or {}).get("retryDelay")
    if not isinstance(delay, str) or not _DURATION.fullmatch(delay):
        return {}
    seconds = float(delay[:-1])
    return {"retry-after-ms": str(round(seconds * 1000)), "retry-after": str(math.ceil(seconds))}


def error(status: int, body: bytes, response_headers: Mapping[str, str]) -> GatewayError:
    message, detail = error_text(body)
    return _error(status, message, detail, response_headers)


def _error(
    status: int, message: str, detail: Mapping[str, Any], response_headers: Mapping[str, str]
) -> GatewayError:
    """Google's error (`detail`: its `error` object) as the client sees it, said in the status line
    or inside a 200 stream: its retry hint as headers, a refused key as the gateway's."""
    kind = detail.get("status")
    if status == 400 and (_detail(detail, _ERROR_INFO) or {}).get("reason") == _KEY_REFUSED:
        status = 401  # the gateway's key, not the request: fails over as another vendor's 401 does
    elif status == 400 and kind == _ACCOUNT_REFUSED:
        status = 403  # the gateway's project: fails over as a project without access to the model does
    headers: Mapping[str, str] = response_headers
    hint = retry_hint(detail)
    if hint and not any(name.lower() in ("retry-after", "retry-after-ms") for name in response_headers):
        headers = {**response_headers, **hint}  # a header of its own, were there one, would win
    return upstream_error(
        status, message, headers, vendor="Gemini", code=kind if isinstance(kind, str) else None
    )


def embeddings_request(backend: Backend, request: EmbeddingRequest, model: str) -> UpstreamRequest:
    texts = request.input
    if isinstance(texts, str):
        texts = [texts]
    if not all(isinstance(text, str) for text in texts):
        raise InvalidRequest("Gemini embedding models take text input, not token ids", param="input")
    entry: dict[str, Any] = {"model": f"models/{model}"}
    if request.dimensions is not None:
        entry["outputDimensionality"] = request.dimensions
    body = {"requests": [{**entry, "content": {"parts": [{"text": text}]}} for text in texts]}
    return UpstreamRequest(
        _url(backend, model, "batchEmbedContents"), API.headers(backend), json_encode(body)
    )


def embeddings_response(body: bytes, model: str) -> EmbeddingResponse:
    data = decode_json(body, "the Gemini backend")
    embeddings = data.get("embeddings") if isinstance(data, dict) else None
    if not isinstance(embeddings, list):
        raise BadGateway("the Gemini backend returned an unexpected embeddings response")
    return EmbeddingResponse(
        data=[Embedding(index=i, embedding=item.get("values", [])) for i, item in enumerate(embeddings)],
        model=model,
        usage=normalise_usage(VENDOR, data.get("usageMetadata")),
    )


def count_tokens_request(backend: Backend, request: ChatRequest, model: str) -> UpstreamRequest:
    # The whole generateContent request, so the system instruction and tools are counted too.
    body = {"generateContentRequest": {"model": f"models/{model}", **chat_body(request, model)}}
    return UpstreamRequest(_url(backend, model, "countTokens"), API.headers(backend), json_encode(body))


def count_tokens_response(body: bytes, model: str) -> TokenCount:
    return token_count(body, "totalTokens", "the Gemini backend")


PROVIDER = Provider(
    name=VENDOR,
    chat_request=chat_request,
    chat_response=chat_response,
    chat_stream=ChatStream,
    error=error,
    empty_answer=empty_answer,
    models_request=API.models_request,
    embeddings_request=embeddings_request,
    embeddings_response=embeddings_response,
    count_tokens_request=count_tokens_request,
    count_tokens_response=count_tokens_response,
    continuation=continuation,
    parallel_tool_calls_switch=False,
    chat_response_to=chat_response_to,
)
