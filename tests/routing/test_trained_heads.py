"""Trained difficulty heads: the bundle a head travels in, the store that loads the heads routes name
(SQLite here), and the policy that scores with them or says why it could not."""

from __future__ import annotations

import asyncio
import json
import struct
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from safetensors.numpy import save
from sqlalchemy import create_engine

from gateway.config import parse_config
from gateway.db.models import Base, DifficultyHeadRow
from gateway.db.session import create_engine as create_async_engine
from gateway.db.session import sessionmaker
from gateway.router_basic import ModelTable
from gateway.transport import Transport
from routing import heads as heads_module
from routing.difficulty import DEFAULT_HEAD_DIR, DifficultyClassifier, DifficultyHead, encode
from routing.heads import (
    HeadStore,
    TrainedHead,
    bundle,
    classifier_from_bundle,
    digest,
    put_head,
    read_bundle,
    stored_bundle,
    unbundle,
)
from routing.plan import Choice, Features, Lesson, Plan
from routing.policies import PolicyContext, difficulty
from routing.router import RouteError, Router, validate
from routing.routes import Route
from routing.stats import RoutingStats
from tests.routing.difficulty_route import CONFIG, DIFFICULTY
from tests.routing.forced_heads import forced

PROMPTS = [
    "hello",
    "Prove that there are infinitely many primes.",
    "Which is a noble gas?\nA. Oxygen\nB. Argon\nC. Iron\nD. Sodium\nAnswer:",
]
CANDIDATES = DIFFICULTY.candidates
HI = Features(
    prompt="hi",
    history_chars=None,
    last_user="hi",
    prompt_tokens=1,
    requested_output_tokens=None,
    tools=False,
    images=False,
    metadata={},
    tags=frozenset(),
    tenant=None,
    key_id=None,
)


def test_a_bundle_round_trips_exactly(classifier: DifficultyClassifier) -> None:
    head = DifficultyHead.load(DEFAULT_HEAD_DIR)
    data = bundle(head)
    again = unbundle(data)
    assert again.meta == head.meta
    enc = encode(classifier.embedder, PROMPTS)
    np.testing.assert_array_equal(again.p_strong(enc), head.p_strong(enc))
    served = classifier_from_bundle(data)
    assert served.embedder is classifier.embedder  # one MiniLM per process, shared
    assert [served.score(p) for p in PROMPTS] == [classifier.score(p) for p in PROMPTS]
    assert digest(data) == digest(bundle(DifficultyHead.load(DEFAULT_HEAD_DIR)))  # deterministic


def _tampered(change: str) -> bytes:
    head = DifficultyHead.load(DEFAULT_HEAD_DIR)
    tensors, meta = head.tensors(), dict(head.meta)
    if change == "version":
        meta["version"] = 999
    elif change == "embedder":
        meta["embedder"] = "minilm-l6-first9-v0"
    elif change == "missing":
        del tensors["w2"]
    elif change == "shape":
        tensors["w2"] = tensors["w2"][:, :-1].copy()
    elif change == "nan":
        tensors["b1"][3] = np.nan
    elif change == "vocabulary":
        tensors["bag"] = tensors["bag"][:1000].copy()
    return save(tensors, metadata={heads_module.BUNDLE_KEY: json.dumps(meta)})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "expected a safetensors file"),
        (b"GIF89a and then some bytes that are not a head", "expected a safetensors file"),
        (struct.pack("<Q", 2) + b"{}", "header metadata"),
        (save({"x": np.zeros(2, np.float32)}), "header metadata"),
        (_tampered("version"), "version 999"),
        (_tampered("embedder"), "unknown embedder recipe"),
        (_tampered("missing"), "lacks tensors w2"),
        (_tampered("shape"), "w2 has shape"),
        (_tampered("nan"), "b1 holds NaN"),
        (_tampered("vocabulary"), "bag has shape"),
    ],
)
def test_a_bad_bundle_is_refused_with_a_reason(data: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        unbundle(data)


def test_read_bundle_takes_a_head_directory_or_a_bundle_file(tmp_path: Path) -> None:
    from_dir = read_bundle(DEFAULT_HEAD_DIR)
    assert unbundle(from_dir).meta == DifficultyHead.load(DEFAULT_HEAD_DIR).meta
    (tmp_path / "head.safetensors").write_bytes(from_dir)
    assert read_bundle(tmp_path / "head.safetensors") == from_dir
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no difficulty head"):
        read_bundle(tmp_path / "empty")
    (tmp_path / "notes.txt").write_text("not a head")
    with pytest.raises(ValueError, match="not a difficulty head bundle"):
        read_bundle(tmp_path / "notes.txt")


def test_only_a_difficulty_route_names_a_head() -> None:
    models = {"gpt-4o-mini", "gpt-4o"}
    validate([Route(name="smart", policy="difficulty", candidates=CANDIDATES, head="acme-v2.1")], models)
    with pytest.raises(RouteError, match="only the difficulty policy"):
        validate([Route(name="smart", candidates=CANDIDATES, head="acme")], models)
    with pytest.raises(RouteError, match="not a head name"):
        validate([Route(name="smart", policy="difficulty", candidates=CANDIDATES, head="../etc")], models)


@pytest.fixture
def sessions(tmp_path: Path) -> object:
    """An admin DB (SQLite) with every table, and an async sessionmaker on it."""
    path = tmp_path / "weir.db"
    Base.metadata.create_all(create_engine(f"sqlite:///{path}"))
    return sessionmaker(create_async_engine(f"sqlite+aiosqlite:///{path}"))


async def _put(sessions: object, name: str, head: DifficultyHead) -> str:
    data = bundle(head)
    async with sessions() as session, session.begin():  # type: ignore[operator]
        await put_head(session, name, data, head)
    return digest(data)


async def _until(condition: object, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_the_store_loads_what_routes_name_swaps_replacements_and_says_why_not(sessions: object) -> None:
    loaded: list[str] = []
    unavailable: list[int] = []
    stand_in = SimpleNamespace(score=lambda prompt: 0.5, embedder=SimpleNamespace(recipe="r"))

    def load(data: bytes) -> object:
        if b"refuse me" in data:
            raise ValueError("this replica cannot build it")
        loaded.append(digest(data))
        return stand_in

    store = HeadStore(sessions, interval=0.05, load=load, on_unavailable=lambda: unavailable.append(1))  # type: ignore[arg-type]
    first = await _put(sessions, "acme", forced(5.0))
    await store.start()
    try:
        assert store.pending() == [] and store.get("acme") is None  # stored, but no route names it
        store.want({"acme", "ghost"})
        assert store.status("acme") == "loading"
        assert await store.loaded("acme") == TrainedHead("acme", first, stand_in)  # type: ignore[arg-type]
        assert store.get("acme").label == f"acme@{first[:12]}"  # type: ignore[union-attr]
        assert store.status("ghost") == "missing" and unavailable  # no such head: the shipped one serves

        # Replaced under the same name: the poller notices, loads it, swaps it in.
        second = await _put(sessions, "acme", forced(-5.0))
        await _until(lambda: store.get("acme") is not None and store.get("acme").digest == second)  # type: ignore[union-attr]
        assert loaded == [first, second]

        # A replacement this replica cannot load: the version before keeps serving, and the same
        # bytes are not tried again.
        head = forced(1.0)
        head.meta["source"] = "refuse me"
        refused = await _put(sessions, "acme", head)
        await _until(lambda: "acme" in store.failed)
        assert store.failed["acme"] == (refused, "this replica cannot build it")
        assert store.get("acme").digest == second  # type: ignore[union-attr]
        await asyncio.sleep(0.2)
        assert loaded == [first, second]
        # A head whose only version fails says so; a new version under its name is tried.
        await _put(sessions, "beta", head)
        store.want({"acme", "beta"})
        before = len(unavailable)
        await _until(lambda: store.status("beta") == "failed")
        assert store.get("beta") is None and len(unavailable) == before + 1  # the shipped head warms
        fixed = await _put(sessions, "beta", forced(3.0))
        await _until(lambda: store.get("beta") is not None)
        assert store.get("beta").digest == fixed and store.status("beta") == "loaded"  # type: ignore[union-attr]

        # No route names it any more: let go of it.
        third = await _put(sessions, "acme", forced(2.0))
        await _until(lambda: store.get("acme") is not None and store.get("acme").digest == third)  # type: ignore[union-attr]
        store.want(set())
        assert store.get("acme") is None
    finally:
        await store.stop()


async def test_the_store_lets_go_of_loads_of_heads_no_route_names(sessions: object) -> None:
    """A finished load task per head name ever named, and a failed bundle's error, were kept for as
    long as the replica ran while routes named head after head. A head named again loads afresh,
    and a bundle that failed is tried again (and fails again, saying so)."""
    stand_in = SimpleNamespace(score=lambda prompt: 0.5, embedder=SimpleNamespace(recipe="r"))

    def load(data: bytes) -> object:
        if b"refuse me" in data:
            raise ValueError("this replica cannot build it")
        return stand_in

    refused = forced(1.0)
    refused.meta["source"] = "refuse me"
    for i in range(20):
        await _put(sessions, f"h{i}", refused if i % 2 else forced(float(i)))
    store = HeadStore(sessions, interval=60, load=load)  # type: ignore[arg-type]
    await store.start()
    try:
        for i in range(20):
            store.want({"h0", f"h{i}"})  # one head stays named throughout
            await store.loaded(f"h{i}")
        assert set(store._tasks) == {"h0", "h19"} and set(store.failed) == {"h19"}
        store.want({"h0"})
        assert set(store._tasks) == {"h0"} and store.failed == {}
        assert store.status("h0") == "loaded"
        store.want({"h0", "h2", "h3"})
        assert await store.loaded("h2") is not None and store.status("h2") == "loaded"
        await store.loaded("h3")
        assert store.status("h3") == "failed"
    finally:
        await store.stop()


async def test_the_policy_scores_with_the_named_head_and_names_it() -> None:
    trained = TrainedHead("acme", "ab" * 32, SimpleNamespace(score=lambda prompt: 0.9))  # type: ignore[arg-type]
    store = SimpleNamespace(
        get=lambda name: trained if name == "acme" else None, status=lambda name: "loading"
    )
    ctx = PolicyContext(RoutingStats(), scorer=lambda prompt: 0.1, heads=store)  # type: ignore[arg-type]
    ctx.serving = "static"
    table = ModelTable(parse_config(CONFIG, {}))

    async def ask(route: Route) -> tuple[str, str]:
        """Where the route sends a request that is then sent (what the policy learnt is kept)."""
        choices = [Choice(table.targets[c.model], c) for c in route.candidates]
        lessons: list[Lesson] = []
        ordered, note = await difficulty(route, choices, HI, ctx, lessons)
        Plan(route, ordered, lessons=lessons).commit()
        # Each candidate carries the score and the head that gave it (compare stores both).
        assert {(c.score, c.scored_by) for c in ordered} == {
            (ordered[0].score, note.split("head=")[1].split(";")[0])
        }
        return ordered[0].candidate.model, note

    named = Route(name="smart", policy="difficulty", candidates=CANDIDATES, head="acme")
    assert await ask(named) == ("gpt-4o", f"threshold=0.5; head=acme@{'ab' * 6}")
    shipped = Route(name="smart", policy="difficulty", candidates=CANDIDATES)
    assert await ask(shipped) == ("gpt-4o-mini", "threshold=0.5; head=static")
    loading = Route(name="smart", policy="difficulty", candidates=CANDIDATES, head="next")
    assert await ask(loading) == (
        "gpt-4o-mini",
        "threshold=0.5; head=static; head_wanted=next; head_status=loading",
    )
    # Neither head loaded yet (a route added just now): wait for the trained head's load in flight
    # rather than start loading the shipped one as well.
    waited: list[str] = []

    async def loaded(name: str) -> TrainedHead:
        waited.append(name)
        return trained

    cold = PolicyContext(RoutingStats(), heads=SimpleNamespace(get=lambda name: None, loaded=loaded))  # type: ignore[arg-type]
    choices = [Choice(table.targets[c.model], c) for c in named.candidates]
    ordered, note = await difficulty(named, choices, HI, cold, None)
    assert waited == ["acme"] and ordered[0].candidate.model == "gpt-4o" and "head=acme@" in note
    assert cold.scorer is None and cold.serving is None  # the shipped head was never loaded
    # A target share keeps one window per head: a new head's scores are not ranked among the old's.
    shared = Route(name="smart", policy="difficulty", candidates=CANDIDATES, head="acme", strong_share=0.3)
    await ask(shared)
    await ask(Route(name="smart", policy="difficulty", candidates=CANDIDATES, strong_share=0.3))
    assert set(ctx.calibrators) == {("smart", f"acme@{'ab' * 6}"), ("smart", "static")}


@pytest.fixture
def shipped(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The heads asked of `DifficultyClassifier.default` (a stand-in scoring 0.1: loading the shipped
    head is not under test)."""
    asked: list[str] = []
    monkeypatch.setattr(
        DifficultyClassifier,
        "default",
        staticmethod(
            lambda head="auto": asked.append(head) or SimpleNamespace(score=lambda p: 0.1, kind="static")
        ),
    )
    return asked


async def test_readiness_waits_for_the_heads_routes_name_at_start(
    sessions: object, shipped: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    stand_in = SimpleNamespace(score=lambda prompt: 0.9, embedder=SimpleNamespace(recipe="r"))

    def load(data: bytes) -> object:
        release.wait(10)
        return stand_in

    monkeypatch.setattr(heads_module, "classifier_from_bundle", load)
    stored = await _put(sessions, "acme", forced(5.0))
    route = Route(name="smart", policy="difficulty", candidates=CANDIDATES, head="acme", probe_interval=None)
    registry = CollectorRegistry()
    router = Router(ModelTable(parse_config(CONFIG, {})), [route], registry=registry)
    router.use_control_plane(sessions, None)
    transport = Transport()
    await router.start(transport)

    def state(name: str, digest12: str = "") -> float | None:
        return registry.get_sample_value(
            "weir_difficulty_trained_head", {"head": "acme", "state": name, "digest": digest12}
        )

    try:
        assert router.scorer_loading  # a load balancer holds traffic back until the head is in
        assert shipped == []  # the route's own head is coming: the shipped one is not loaded
        assert state("loading") == 1
        release.set()
        await _until(lambda: not router.scorer_loading)
        assert router.heads is not None and router.heads.get("acme") is not None
        assert state("loaded", stored[:12]) == 1 and state("loading") is None
    finally:
        release.set()
        await router.stop()
        await transport.close()


async def test_a_route_whose_head_is_missing_falls_back_to_the_shipped_head(
    sessions: object, shipped: list[str]
) -> None:
    route = Route(name="smart", policy="difficulty", candidates=CANDIDATES, head="gone", probe_interval=None)
    router = Router(ModelTable(parse_config(CONFIG, {})), [route])
    router.use_control_plane(sessions, None)
    transport = Transport()
    await router.start(transport)
    try:
        assert router._warming is not None  # the fallback is loaded at once, not on the first request
        await router._warming
        assert shipped == ["auto"] and not router.scorer_loading
        assert router.heads is not None and router.heads.status("gone") == "missing"
        _, note = await difficulty(
            route,
            [Choice(router.models.targets[c.model], c) for c in route.candidates],
            HI,
            router.context,
            None,
        )
        assert note.endswith("head=static; head_wanted=gone; head_status=missing")
    finally:
        await router.stop()
        await transport.close()


def test_a_head_is_stored_with_its_digest_and_metadata(sessions: object) -> None:
    async def main() -> tuple[DifficultyHeadRow, tuple[str, bytes] | None]:
        await _put(sessions, "acme", forced(5.0))
        async with sessions() as session:  # type: ignore[operator]
            # The bytes are a deferred column: listing and reading a head leave them in the DB.
            return await session.get(DifficultyHeadRow, "acme"), await stored_bundle(session, "acme")

    row, stored = asyncio.run(main())
    assert "bundle" not in row.__dict__
    assert stored is not None and stored[0] == row.digest
    assert row.digest == digest(stored[1]) and row.size == len(stored[1])
    assert row.embedder == DifficultyHead.load(DEFAULT_HEAD_DIR).embedder
    assert row.meta["source"] == "test head, bias 5.0"
