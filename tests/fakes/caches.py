"""Prompt caches that behave like each vendor's, so accounting tests see realistic numbers.

- `AutomaticPrefixCache` (OpenAI, DeepSeek): every prompt is remembered; a later prompt reports as
  cached the longest prefix seen before, rounded down to the vendor's increment (OpenAI: prompts of
  at least 1024 tokens, prefixes of 1024 + k*128 tokens; DeepSeek: multiples of 64 tokens).
- `BreakpointCache` (Anthropic): only prefixes ending at a `cache_control` breakpoint are cached, and
  only when at least `min_tokens` long (1024, as for Sonnet/Opus). A request reads the longest cached
  prefix ending at a block boundary no more than 20 blocks before one of its breakpoints, then writes
  everything from there to its last breakpoint, each segment at the TTL of the breakpoint that ends it
  ("5m" or "1h"). Tokens after the last breakpoint are plain input. Entries expire after their TTL,
  refreshed by every read.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field


def _prefix_digests(tokens: Sequence[str], positions: Sequence[int]) -> dict[int, bytes]:
    """sha256 of tokens[:p] for each p in positions (ascending), in one pass."""
    digests: dict[int, bytes] = {}
    h = hashlib.sha256()
    done = 0
    for p in sorted(set(positions)):
        for tok in tokens[done:p]:
            h.update(tok.encode())
            h.update(b"\x00")
        done = p
        digests[p] = h.copy().digest()
    return digests


@dataclass
class AutomaticPrefixCache:
    minimum: int = 1024
    increment: int = 128
    _seen: set[bytes] = field(default_factory=set)

    def _boundaries(self, n: int) -> list[int]:
        return list(range(self.minimum, n + 1, self.increment)) if n >= self.minimum else []

    def lookup_and_store(self, tokens: Sequence[str]) -> int:
        """Cached tokens for this prompt; then remember it for the next ones."""
        digests = _prefix_digests(tokens, self._boundaries(len(tokens)))
        cached = max((p for p, d in digests.items() if d in self._seen), default=0)
        self._seen.update(digests.values())
        return cached

    def clear(self) -> None:
        self._seen.clear()


@dataclass
class Block:
    tokens: list[str]
    ttl: str | None = None  # "5m" or "1h" when the block carries a cache_control breakpoint


@dataclass
class CacheResult:
    read: int = 0
    write_5m: int = 0
    write_1h: int = 0
    uncached: int = 0


_TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}
_LOOKBACK_BLOCKS = 20


@dataclass
class BreakpointCache:
    min_tokens: int = 1024
    _entries: dict[bytes, tuple[float, str]] = field(default_factory=dict)  # digest -> (expiry, ttl)

    def process(self, blocks: Sequence[Block], now: float | None = None) -> CacheResult:
        now = time.monotonic() if now is None else now
        tokens: list[str] = []
        ends: list[int] = []  # token position after each block
        for block in blocks:
            tokens.extend(block.tokens)
            ends.append(len(tokens))
        breakpoints = [
            (i, ends[i], b.ttl) for i, b in enumerate(blocks) if b.ttl and ends[i] >= self.min_tokens
        ]
        if not breakpoints:
            return CacheResult(uncached=len(tokens))
        candidates = {
            ends[j] for i, _, _ in breakpoints for j in range(max(0, i - _LOOKBACK_BLOCKS + 1), i + 1)
        }
        digests = _prefix_digests(tokens, sorted(candidates))
        read = 0
        for pos in sorted(candidates, reverse=True):
            entry = self._entries.get(digests[pos])
            if entry and entry[0] > now:
                read = pos
                self._entries[digests[pos]] = (now + _TTL_SECONDS[entry[1]], entry[1])
                break
        result = CacheResult(read=read)
        start = read
        for _, pos, ttl in breakpoints:
            if pos <= start:
                continue
            if ttl == "1h":
                result.write_1h += pos - start
            else:
                result.write_5m += pos - start
            start = pos
        for _, pos, ttl in breakpoints:
            if pos > read:
                self._entries[digests[pos]] = (now + _TTL_SECONDS.get(ttl or "5m", 300.0), ttl or "5m")
        result.uncached = len(tokens) - start
        return result

    def clear(self) -> None:
        self._entries.clear()
