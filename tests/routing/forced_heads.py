"""Difficulty heads whose routing no prompt can hide, for the tests of heads, routes and their pages."""

from __future__ import annotations

from routing.difficulty import DEFAULT_HEAD_DIR, DifficultyHead


def forced(bias: float) -> DifficultyHead:
    """The shipped head with its biases moved so far that every prompt scores ~1 (or ~0): a head
    whose routing no prompt can hide."""
    head = DifficultyHead.load(DEFAULT_HEAD_DIR)
    head.blend[-1] = bias
    head.fallback[-1] = bias
    head.meta["source"] = f"test head, bias {bias}"
    return head
