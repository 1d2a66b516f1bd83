"""A plan: the ordered candidates for one request, each with the reason it has its place."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from gateway.estimate import completion_choices, input_tokens
from gateway.providers.base import builtin_tools
from gateway.types import ChatRequest, ImagePart, Message, TextPart, has_cache_control

if TYPE_CHECKING:
    from gateway.router_basic import Target
    from routing.routes import Candidate, Route

# What a policy learns from one request (its score in a strong-share window, prefix affinity's hit or
# miss and the prefixes it sends), kept once the request is sent (`Plan.commit`).
Lesson = Callable[[], None]


@dataclass(frozen=True, slots=True)
class Features:
    """What conditions and policies look at in a request."""

    prompt: str  # the whole conversation's text, in order (prefix affinity)
    # Characters of `prompt` before its last assistant turn (None without one): the text of the
    # conversation's previous request, which prefix affinity looks up.
    history_chars: int | None
    last_user: str  # the last user turn (difficulty)
    # The prompt's length as the gateway estimates it everywhere else (`estimate.input_tokens`, the
    # rule of admission and of the bill of an attempt cut short): everything the vendor bills as input,
    # not only the turns' text: earlier tool calls' arguments (an agent's history is mostly those), the
    # tool definitions, images (inline or by URL). Counted from the text alone, a long tool loop or a
    # question with images matched a `max_prompt_tokens` route for a small context window. The vendor
    # counts exactly afterwards.
    prompt_tokens: int
    # The output limit the request asks for (`max_tokens`, `max_completion_tokens`, a Responses
    # client's `max_output_tokens`; None: none), not the model's own (`Choice.max_output_tokens`).
    requested_output_tokens: int | None
    tools: bool
    images: bool
    metadata: dict[str, str]
    tags: frozenset[str]
    tenant: str | None
    key_id: str | None
    # Whether the request marks a prompt-cache breakpoint (`cache_control` on a part, message or
    # tool, or in blocks kept as the client sent them: `has_cache_control`): Anthropic reads and
    # writes its cache only up to one. None: not known (a route preview).
    cache_breakpoints: bool | None = None
    # The service tier the request asks for (`flex`, `priority`...): `cheapest` prices each candidate
    # at that tier where it prices one (served as asked), as the attempt will be billed.
    service_tier: str | None = None
    # The choices the request asks for (`n`; Gemini's `candidateCount`): each writes its own output,
    # all billed, while the prompt is billed once (`cheapest`, the hedge's spend estimate).
    choices: int = 1


def _turn_text(message: Message) -> str:
    """The text of one user turn as the difficulty classifier reads it: text parts joined by line
    breaks, as `routing.difficulty.prompt_text` joins them for `weir router score` and for training
    on stored requests. (`Message.text` joins them with nothing, which glued "What is" and "2+2?" into
    "What is2+2?": other word pieces than a trained head learnt from for the same request.)"""
    if isinstance(message.content, list):
        return "\n".join(part.text for part in message.content if isinstance(part, TextPart))
    return message.text()


def prompt_request(
    model: str, prompt: str | list[Any], max_tokens: int | None = None, n: int | None = None
) -> ChatRequest:
    """What a routing policy reads (conditions, difficulty, prefix affinity) of a completions or
    embeddings prompt: one user turn of its text; token ids read as none. `max_tokens` and `n`: a
    completions request's output limit and choices."""
    text = prompt if isinstance(prompt, str) else "\n".join(v for v in prompt if isinstance(v, str))
    return ChatRequest(model=model, messages=[Message(role="user", content=text)], max_tokens=max_tokens, n=n)


def _token_ids(prompt: str | list[Any]) -> int:
    """How many token ids a completions or embeddings prompt holds (a list of ids, or lists of them)."""
    if isinstance(prompt, str):
        return 0
    if all(isinstance(v, int) for v in prompt):
        return len(prompt)
    return sum(len(v) for v in prompt if isinstance(v, list))


def prompt_features(
    model: str,
    prompt: str | list[Any],
    tenant: str | None,
    key_id: str | None,
    max_tokens: int | None = None,
    n: int | None = None,
    best_of: int | None = None,
) -> Features:
    """The features of a completions or embeddings request (`prompt_request`), its length counting
    each token id as the token it is: read as no text, a prompt of 5,000 ids passed a route's
    `max_prompt_tokens: 1000` condition and `cheapest`'s fit in a small window. `max_tokens`: its
    output limit, as a chat's (`cheapest` fits it, `x-weir-route` says `output_capped`); its choices
    are those it generates and is billed for (`completion_choices`: `best_of`, at least `n`, for each
    of its prompts), as admission reserves them."""
    feats = features(prompt_request(model, prompt, max_tokens, n), tenant, key_id)
    feats = replace(feats, choices=completion_choices(n, best_of, prompt))
    ids = _token_ids(prompt)
    return replace(feats, prompt_tokens=feats.prompt_tokens + ids) if ids else feats


def features(
    request: ChatRequest, tenant: str | None, key_id: str | None, metadata: dict[str, str] | None = None
) -> Features:
    """`metadata`: the metadata the client sent in its own API, where the canonical request does not
    carry it as `request.metadata` (the Messages API's `metadata.user_id` goes upstream as `user`)."""
    texts: list[str] = []
    last_user = ""
    images = False
    history_chars: int | None = None
    chars = -1  # of "\n".join(texts) so far
    for message in request.messages:
        text = message.text()
        if message.role == "assistant":
            history_chars = max(chars, 0)
        texts.append(text)
        chars += len(text) + 1
        if message.role == "user":
            last_user = _turn_text(message)
        if isinstance(message.content, list):
            images = images or any(isinstance(part, ImagePart) for part in message.content)
    metadata = (request.metadata if metadata is None else metadata) or {}
    return Features(
        prompt="\n".join(texts),
        history_chars=history_chars,
        last_user=last_user,
        prompt_tokens=input_tokens(request),
        requested_output_tokens=request.output_limit,
        # Function tools, Anthropic's own (a web search) and a Responses client's built-in ones alike.
        tools=bool(request.tools or request.anthropic_tools or builtin_tools(request)),
        images=images,
        metadata=metadata,
        tags=frozenset(t.strip() for t in metadata.get("tags", "").split(",") if t.strip()),
        tenant=tenant,
        key_id=key_id,
        cache_breakpoints=has_cache_control(request),
        service_tier=request.service_tier,
        choices=max(request.n or 1, 1),
    )


@dataclass(slots=True)
class Choice:
    target: Target
    candidate: Candidate
    score: float | None = None
    reason: str = ""
    scored_by: str | None = None  # what computed `score` where that varies: a difficulty head's label
    # The output tokens this request's prompt leaves in the model's context window (None: not known),
    # set by the executor as it sends an attempt here (`routing.execute.Executor._fit_context`): from
    # the gateway's estimate of the prompt where it knows the window, or exactly as the backend
    # reported them in its 400. Never at plan time: policies weigh the whole output limit.
    context_room: int | None = None

    @property
    def max_output_tokens(self) -> int | None:
        """The most output tokens an attempt on this choice asks for (None: no limit known): what its
        model writes in one answer, the candidate's own, else its model's (`models[]
        .max_output_tokens`), and once an attempt is sent, at most the room its prompt leaves in the
        context window (`context_room`). The one rule for every choice: a route's candidates, its
        fallbacks, a request for a model by name and a comparison's judge (the last three are bare
        candidates, so they have the model's alone)."""
        own = self.candidate.max_output_tokens
        most = own if own is not None else self.target.model.max_output_tokens
        room = self.context_room
        return room if most is None or (room is not None and room < most) else most

    def output_within(self, tokens: int) -> int:
        """`tokens` of output, at most what the model writes (`max_output_tokens`)."""
        most = self.max_output_tokens
        return tokens if most is None else min(tokens, most)


class Outcome(Protocol):
    """The part of a policy's decision that depends on where the request is served (prefix
    affinity's hit or miss): said in `x-weir-route` of the candidate the header names, and counted
    once a candidate answers (`Plan.serve`), not when the plan is made or its first attempt sent (that
    attempt may fail and another candidate serve the request)."""

    def describe(self, choice: Choice | None, pending: bool) -> str:
        """The header's note for `choice`; `pending`: an attempt on it is under way (the header its
        answer goes out with), not yet counted."""
        ...

    def served(self, choice: Choice) -> None:
        """`choice` answered the request: count it."""
        ...


@dataclass(slots=True)
class Plan:
    route: Route
    choices: list[Choice]  # in the order they are tried
    note: str = ""  # policy-wide detail (difficulty score, affinity hit)
    attempts: int = 0
    chosen: Choice | None = None  # the candidate that answered
    # The latest attempt's candidate: what the header names while none answered, and when none did
    # (the client's error, and the ledger's last row, are that attempt's), not the plan's first
    # choice, which may have been skipped (its breaker open) or failed long before.
    latest: Choice | None = None
    tried: list[str] = field(default_factory=list)  # "model:outcome" per attempt
    lessons: list[Lesson] = field(default_factory=list)  # what `commit` keeps
    outcome: Outcome | None = None  # what `serve` counts and the header says of the candidate it names
    # The request's output limit (`Features.requested_output_tokens`; None: none): the header says where a
    # choice's `max_output_tokens` lowers it (`routing.execute.within_output_limit`).
    output_limit: int | None = None
    # The prompt's length as the gateway estimates it (`Features.prompt_tokens`; None: not known): what
    # a candidate's known context window leaves for output (`Choice.context_room`).
    prompt_tokens: int | None = None

    def commit(self) -> None:
        """The request's first attempt was admitted and went upstream: keep what the policy learnt from
        it. Not before: a request the gateway refuses (its own 429s, which clients retry in a loop)
        sends nothing to any candidate, and is no traffic to learn from. Once: a failover's or a
        hedge's later attempts add nothing."""
        lessons, self.lessons = self.lessons, []
        for lesson in lessons:
            lesson()

    def serve(self, choice: Choice) -> None:
        """`choice` answered (a whole answer, or a stream's first output): the request's outcome is
        counted where it was served, once (a stream that later continues elsewhere was served here)."""
        first = self.chosen is None
        self.chosen = choice
        if first and self.outcome is not None:
            self.outcome.served(choice)

    def attempt(self, choice: Choice) -> int:
        """Count an attempt on `choice`: its number."""
        self.attempts += 1
        self.latest = choice
        return self.attempts

    def header(self, trying: Choice | None = None) -> str:
        """The `x-weir-route` header: policy, candidate, score, attempts (and why). The candidate is
        `trying`'s, else the one that answered, else the latest attempt's (the one whose failure the
        client got), else, nothing tried, the plan's first choice."""
        chosen = trying or self.chosen or self.latest or (self.choices[0] if self.choices else None)
        parts = [f"route={self.route.name}", f"policy={self.route.policy}"]
        if chosen is not None:
            parts.append(f"candidate={chosen.candidate.model}")
            if chosen.score is not None:
                parts.append(f"score={chosen.score:.6g}")
            if chosen.reason:
                parts.append(f"reason={chosen.reason}")
            limit = self.output_limit
            if limit is not None and chosen.output_within(limit) < limit:
                parts.append(f"output_capped={chosen.max_output_tokens}")
        parts.append(f"attempts={self.attempts}")
        # An attempt on `trying` is under way (the header its answer goes out with, and its usage
        # event's text), not yet noted in `tried`.
        pending = trying is not None and self.chosen is None
        if self.outcome is not None:
            parts.append(self.outcome.describe(chosen, pending=pending))
        if self.note:
            parts.append(self.note)
        # Shown once there is more than one attempt or skip, the one under way counted: a request that
        # skipped `a` (`a:open`) for `b` said so in the header sent after `b` answered, but not in the
        # text of `b`'s usage event, made while `b` was still pending (nor in a stream's header).
        if len(self.tried) + pending > 1:
            parts.append("tried=" + ",".join(self.tried))
        return "; ".join(parts)
