"""Structured output: JSON (any object, or one matching a JSON Schema) enforced token by token.

xgrammar compiles the grammar against the model's vocabulary once (cached per schema); each request keeps
a matcher that says which tokens may come next. The sampler masks every other token out of the row, so
the model can only write text the grammar accepts; once the JSON is complete only an end-of-sequence
token is allowed, and the request finishes with "stop". JSON is written compactly (no free whitespace
between tokens of the JSON syntax).
"""

from __future__ import annotations

import functools
import json
import re
from typing import TYPE_CHECKING

import torch
import xgrammar as xgr

from engine.sampling import InvalidSamplingParam, JsonFormat

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer


# xgrammar's errors start with its log line's time and C++ source position, "[22:24:41]
# /project/cpp/json_schema_converter.cc:5082: ", which tell an API client nothing
_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
ANY_OBJECT = '{"type": "object"}'  # OpenAI's json_object: a JSON object, not any JSON value
_VOCAB_TYPES = {
    "raw": xgr.VocabType.RAW,
    "byte_level": xgr.VocabType.BYTE_LEVEL,
    "byte_fallback": xgr.VocabType.BYTE_FALLBACK,
}


class Grammars:
    """Compiled grammars for one model's vocabulary, and matchers built from them."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo(
            tokenizer.vocabulary(vocab_size),
            vocab_type=_VOCAB_TYPES[tokenizer.vocab_kind],
            vocab_size=vocab_size,
            stop_token_ids=sorted(tokenizer.eos_token_ids),
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        # shifts that unpack xgrammar's int32 bitmask (bit j of word i: token 32 * i + j)
        self._bits = torch.arange(32, dtype=torch.int32)
        # one bitmask for every matcher: the engine loop fills and unpacks one at a time
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    @functools.lru_cache(maxsize=64)  # noqa: B019 (one Grammars per engine, kept for its life)
    def _compiled(self, fmt: JsonFormat) -> xgr.CompiledGrammar:
        # compact JSON: with whitespace allowed anywhere, small models drift into endless runs of it
        if not (fmt.prefix or fmt.suffix):
            return self._compiler.compile_json_schema(fmt.schema or ANY_OBJECT, any_whitespace=False)
        json_part = xgr.Grammar.from_json_schema(fmt.schema or ANY_OBJECT, any_whitespace=False)
        parts = [_literal(fmt.prefix), json_part, _literal(fmt.suffix)]
        return self._compiler.compile_grammar(xgr.Grammar.concat(*(p for p in parts if p is not None)))

    def compile(self, fmt: JsonFormat) -> xgr.CompiledGrammar:
        """`fmt`'s grammar, compiled once (cached); ValueError (a 400 for the client) if the schema is not
        valid. Any thread may call it."""
        try:
            return self._compiled(fmt)
        except (RuntimeError, ValueError) as exc:
            reason = _XGRAMMAR_LOG_PREFIX.sub("", str(exc)).strip()
            raise InvalidSamplingParam(
                fmt.param, f"{fmt.param}: the JSON schema cannot be used: {reason}"
            ) from exc

    def start(self, fmt: JsonFormat) -> GrammarState:
        """One request's state; ValueError (a 400 for the client) if the schema is not valid."""
        return GrammarState(self, xgr.GrammarMatcher(self.compile(fmt)))

    def allowed(self, matcher: xgr.GrammarMatcher) -> torch.Tensor:
        """Bool [vocab_size]: the tokens `matcher` accepts next."""
        matcher.fill_next_token_bitmask(self._bitmask)
        bits = (self._bitmask[0].unsqueeze(1) >> self._bits) & 1
        return bits.reshape(-1)[: self.vocab_size].bool()


def _literal(text: str) -> xgr.Grammar | None:
    """A grammar of exactly `text` (JSON string escapes are EBNF's), or None for no text."""
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}") if text else None


class GrammarState:
    """Where one request is in its grammar: which tokens may come next, and whether it is complete."""

    def __init__(self, grammars: Grammars, matcher: xgr.GrammarMatcher) -> None:
        self._grammars, self._matcher = grammars, matcher

    def allowed(self) -> torch.Tensor:
        """Bool [vocab_size]: the tokens the grammar accepts next."""
        return self._grammars.allowed(self._matcher)

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):
            raise RuntimeError(f"token {token} is outside the grammar (the sampler masks such tokens)")

    @property
    def complete(self) -> bool:
        return self._matcher.is_terminated()
