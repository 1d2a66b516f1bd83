"""One request's state inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.grammar import GrammarState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission
    finish_reason: str | None = None
    stop_token_id: int | None = None  # the request's stop_token_ids token that ended it (vLLM's stop_reason)
    # prompt log-probs gathered chunk by chunk; reported once, in the first output
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False
    num_preemptions: int = 0
    last_scheduled: int = 0  # the scheduler step that last gave it tokens (it serves the oldest first)
    # speculative tokens proposed for this step, not yet verified (not part of num_tokens)
    draft_token_ids: list[int] = field(default_factory=list)
    grammar: GrammarState | None = None  # structured output: what the grammar accepts next
    # min_tokens: the tokens that would end the request (EOS, stop tokens), banned until it has that many
    min_tokens_banned: list[int] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_ids(self, start: int = 0, end: int | None = None) -> list[int]:
        """Prompt and output tokens together, sliced [start, end); past the end come the drafts."""
        n, total = len(self.prompt_token_ids), self.num_tokens
        end = total if end is None else end
        if end > total:
            drafts = self.draft_token_ids[max(start - total, 0) : end - total]
            return self.token_ids(min(start, total), total) + drafts
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
