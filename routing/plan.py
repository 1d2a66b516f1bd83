"""A plan: the ordered candidates for one request, each with the reason it has its place."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.types import ChatRequest, ImagePart

if TYPE_CHECKING:
    from gateway.router_basic import Target
    from routing.routes import Candidate, Route

CHARS_PER_TOKEN = 4  # estimate, for conditions and cost; the vendor counts exactly afterwards


@dataclass(frozen=True, slots=True)
class Features:
    """What conditions and policies look at in a request."""

    prompt: str  # the whole conversation's text, in order (prefix affinity)
    # Characters of `prompt` before its last assistant turn (None without one): the text of the
    # conversation's previous request, which prefix affinity looks up.
    history_chars: int | None
    last_user: str  # the last user turn (difficulty)
    prompt_tokens: int
    max_output_tokens: int | None
    tools: bool
    images: bool
    metadata: dict[str, str]
    tags: frozenset[str]
    tenant: str | None
    key_id: str | None


def features(request: ChatRequest, tenant: str | None, key_id: str | None) -> Features:
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
            last_user = text
        if isinstance(message.content, list):
            images = images or any(isinstance(part, ImagePart) for part in message.content)
    prompt = "\n".join(texts)
    metadata = request.metadata or {}
    return Features(
        prompt=prompt,
        history_chars=history_chars,
        last_user=last_user,
        prompt_tokens=len(prompt) // CHARS_PER_TOKEN + 1,
        max_output_tokens=request.output_limit,
        tools=bool(request.tools),
        images=images,
        metadata=metadata,
        tags=frozenset(t.strip() for t in metadata.get("tags", "").split(",") if t.strip()),
        tenant=tenant,
        key_id=key_id,
    )


@dataclass(slots=True)
class Choice:
    target: Target
    candidate: Candidate
    score: float | None = None
    reason: str = ""
    scored_by: str | None = None  # what computed `score` where that varies: a difficulty head's label


@dataclass(slots=True)
class Plan:
    route: Route
    choices: list[Choice]  # in the order they are tried
    note: str = ""  # policy-wide detail (difficulty score, affinity hit)
    attempts: int = 0
    chosen: Choice | None = None
    tried: list[str] = field(default_factory=list)  # "model:outcome" per attempt

    def header(self, trying: Choice | None = None) -> str:
        """The `x-weir-route` header: policy, chosen candidate, score, attempts (and why)."""
        chosen = trying or self.chosen or (self.choices[0] if self.choices else None)
        parts = [f"route={self.route.name}", f"policy={self.route.policy}"]
        if chosen is not None:
            parts.append(f"candidate={chosen.candidate.model}")
            if chosen.score is not None:
                parts.append(f"score={chosen.score:.6g}")
            if chosen.reason:
                parts.append(f"reason={chosen.reason}")
        parts.append(f"attempts={self.attempts}")
        if self.note:
            parts.append(self.note)
        if len(self.tried) > 1:
            parts.append("tried=" + ",".join(self.tried))
        return "; ".join(parts)
