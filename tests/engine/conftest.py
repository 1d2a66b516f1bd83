"""Engine test fixtures: tiny random-weight engines and a KV-leak check after every test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from engine.config import tiny_config
from engine.llm_engine import LLMEngine


def assert_no_kv_leak(engine: LLMEngine) -> None:
    """Every block is free and unreferenced once no request is left."""
    assert not engine.has_unfinished_requests(), "test left requests unfinished"
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} KV blocks leaked"
    assert all(rc == 0 for rc in bm.ref_counts)
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0


@pytest.fixture(autouse=True)
def _kv_leak_check(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Record every LLMEngine a test builds and check it for leaked blocks afterwards (the server and
    CLI tests manage engines across processes and threads, and opt in with assert_no_kv_leak)."""
    if request.node.path.name.startswith(("test_server", "test_cli")):
        yield
        return
    engines: list[LLMEngine] = []
    original = LLMEngine.__init__

    def recording_init(self: LLMEngine, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        engines.append(self)

    monkeypatch.setattr(LLMEngine, "__init__", recording_init)
    yield
    for engine in engines:
        assert_no_kv_leak(engine)


@pytest.fixture
def make_engine() -> Callable[..., LLMEngine]:
    """Build a tiny random-weight engine; keyword arguments go to LLMEngine."""

    def make(config_changes: dict[str, Any] | None = None, **kwargs: Any) -> LLMEngine:
        kwargs.setdefault("num_kv_blocks", 256)
        kwargs.setdefault("device", "cpu")
        return LLMEngine.from_config(tiny_config(**(config_changes or {})), **kwargs)

    return make


@pytest.fixture
def tiny_engine(make_engine: Callable[..., LLMEngine]) -> LLMEngine:
    return make_engine()
