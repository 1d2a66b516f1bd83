"""`weir router train --tenant`: refit the difficulty head from a tenant's feedback in the admin DB
(SQLite here; PostgreSQL too where `--install` races an admin), joined with its stored prompts and the
ledger's record of which model answered."""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import json
import random
import subprocess
from pathlib import Path

import click
import numpy as np
import pytest
import structlog
import torch
from click.testing import CliRunner
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

import routing.embed
import routing.heads
from gateway.credentials import prompt_context
from gateway.db.models import (
    Base,
    DifficultyHeadRow,
    Feedback,
    RouteRow,
    StoredPrompt,
    Tenant,
)
from gateway.db.session import create_engine as create_async_engine
from gateway.db.session import sessionmaker
from gateway.vault import Vault, generate_key
from routing.cli import _promote
from routing.difficulty import DifficultyClassifier, DifficultyHead, encode
from routing.embed import WordPieceEmbedder
from routing.feedback import answered_by, load_feedback, request_prompt
from routing.heads import bundle, digest
from routing.ranking import auc
from routing.train import (
    HoldoutResult,
    TrainConfig,
    _fold_rank,
    decisive,
    fit_head,
    holdout_check,
    should_promote,
)
from tests.fixtures.db import sync_exec
from tests.routing.forced_heads import forced
from tests.routing.training_db import (
    DIFFICULTY,
    NOW,
    STRONG,
    WEAK,
    audit_rows,
    ledger_row,
    reached_route,
    route_head,
    set_routes,
)
from tests.routing.weir_command import run
from weir.cli import main

TOPICS = ["apples", "rivers", "poems", "trains", "gardens", "music", "colours", "cities", "birds", "tea"]


def easy(i: int) -> str:
    return f"Say hello and name one thing about {TOPICS[i % 10]}, request {i}."


def hard(i: int) -> str:
    return f"Prove rigorously that the eigenvalues of this operator on {TOPICS[i % 10]} are real, case {i}."


def _chat(prompt: str) -> str:
    return json.dumps(
        {
            "model": "auto",
            "messages": [{"role": "system", "content": "x"}, {"role": "user", "content": prompt}],
        }
    )


def _traffic(session: Session, vault: Vault, rng: random.Random, requests: range) -> None:
    """acme's requests: a stored prompt, the ledger's answering attempt and feedback on it, each. The
    weak model answers easy prompts well and hard ones badly, the strong one both well."""
    for i in requests:
        prompt, is_hard = (hard(i), True) if i % 2 else (easy(i), False)
        candidate = STRONG if i % 4 in (2, 3) else WEAK  # both models see easy and hard prompts
        right = candidate == STRONG or not is_hard
        rid = f"r{i}"
        endpoint = "chat" if i % 3 else "completions"
        body = _chat(prompt) if i % 3 else json.dumps({"model": "auto", "prompt": prompt})
        key_id = None
        if i % 5 == 0:  # some bodies encrypted, as the gateway stores them with a master key
            where = prompt_context("t-acme", rid)
            body, key_id = vault.encrypt(body, where + ":request"), vault.primary_id
            response = vault.encrypt("{}", where + ":response")
        else:
            response = "{}"
        session.add(
            StoredPrompt(
                request_id=rid,
                tenant_id="t-acme",
                ts=NOW,
                endpoint=endpoint,
                status=200,
                key_id=key_id,
                request_body=body,
                response_body=response,
            )
        )
        if i % 7 == 0:  # a failed first attempt: the answer came from the second
            session.add(ledger_row(rid, 1, "t-acme", candidate, 500))
            session.add(ledger_row(rid, 2, "t-acme", candidate, 200))
        else:
            session.add(ledger_row(rid, 1, "t-acme", candidate, 200))
        score = rng.uniform(0.7, 1.0) if right else rng.uniform(0.0, 0.3)
        session.add(Feedback(tenant_id="t-acme", request_id=rid, score=score))


@pytest.fixture
def admin_db(tmp_path: Path) -> tuple[str, Vault]:
    """A tenant `acme` whose weak model answers easy prompts well and hard ones badly, and whose strong
    model answers both well; plus rows the join must skip, and another tenant's feedback."""
    path = tmp_path / "weir.db"
    vault = Vault.from_env({"WEIR_MASTER_KEY": generate_key()})
    assert vault is not None
    engine = create_engine(f"sqlite:///{path}")
    Base.metadata.create_all(engine)
    rng = random.Random(0)
    with Session(engine) as session:
        session.add_all(
            [
                Tenant(id="t-acme", name="acme", store_prompts=True),
                Tenant(id="t-other", name="other", store_prompts=True),
                RouteRow(
                    name="auto",
                    position=0,
                    spec={
                        "name": "auto",
                        "policy": "difficulty",
                        "candidates": [{"model": WEAK}, {"model": STRONG}],
                    },
                ),
            ]
        )
        _traffic(session, vault, rng, range(80))
        # Skipped: no stored prompt, answered by a third model, another tenant's feedback.
        session.add(ledger_row("r-unstored", 1, "t-acme", WEAK, 200))
        session.add(Feedback(tenant_id="t-acme", request_id="r-unstored", score=1.0))
        session.add(ledger_row("r-gemini", 1, "t-acme", "gemini-flash", 200))
        session.add(
            StoredPrompt(
                request_id="r-gemini",
                tenant_id="t-acme",
                ts=NOW,
                endpoint="chat",
                status=200,
                key_id=None,
                request_body=_chat("hi"),
                response_body="{}",
            )
        )
        session.add(Feedback(tenant_id="t-acme", request_id="r-gemini", score=1.0))
        session.add(ledger_row("o1", 1, "t-other", WEAK, 200))
        session.add(Feedback(tenant_id="t-other", request_id="o1", score=0.0))
        session.commit()
    engine.dispose()
    return f"sqlite:///{path}", vault


def cli(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """`weir ARGS` in this process, so that torch and the embedder load once for a test's many runs.
    `router score` points structlog at the runner's stderr for good: the config is put back after."""
    saved = structlog.get_config()
    try:
        result = CliRunner().invoke(main, args, input=stdin)
    finally:
        structlog.configure(**saved)
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


@pytest.fixture
def embed_each_prompt_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The `router train` runs of a test in this process share one MiniLM per recipe, and each prompt's
    embedding: every run re-embedded the same few hundred prompts, one per pass (a prompt's embedding
    is a function of its token ids alone: routing.minilm), which was most of the test's time."""
    real_load = routing.embed.load_embedder
    loaded: dict[str, WordPieceEmbedder] = {}

    def load_once(recipe: str = routing.embed.DEFAULT_RECIPE) -> WordPieceEmbedder:
        if recipe not in loaded:
            embedder = loaded[recipe] = real_load(recipe)
            real_pool, pooled = embedder.pool, dict[tuple[int, ...], np.ndarray]()

            def pool_once(ids: list[int]) -> np.ndarray:
                key = tuple(ids)
                if key not in pooled:
                    pooled[key] = real_pool(ids)
                return pooled[key].copy()

            embedder.pool = pool_once  # type: ignore[method-assign]
        return loaded[recipe]

    monkeypatch.setattr(routing.embed, "load_embedder", load_once)


def train_acme(url: str) -> list[str]:
    """`weir router train` on acme's route `auto` in this admin DB, with few epochs: the tests that use it
    check what the command does with a head (the check, the promotion, the install), and on rows this
    easy the sparse part ranks the held-out ones alike at 3 epochs or 30. Each head is 6 fits (5 of them
    cross-fitted for its calibration), and an --install run fits several heads."""
    return ["router", "train", "--tenant", "acme", "--route", "auto", "--database-url", url, "--epochs", "3"]


def _load(url: str, vault: Vault | None) -> tuple[object, object]:
    async def go() -> tuple[object, object]:
        engine = create_async_engine(url.replace("sqlite://", "sqlite+aiosqlite://"))
        try:
            return await load_feedback(sessionmaker(engine), "acme", WEAK, STRONG, vault)
        finally:
            await engine.dispose()

    return asyncio.run(go())


def test_the_join_labels_only_the_model_that_answered(admin_db: tuple[str, Vault]) -> None:
    url, vault = admin_db
    data, report = _load(url, vault)
    assert len(data) == 80  # type: ignore[arg-type]
    assert report.used == {"both": 0, "weak": 40, "strong": 40}  # type: ignore[attr-defined]
    assert report.skipped == {  # type: ignore[attr-defined]
        "answered by another model": 1,
        "without a stored prompt (store_prompts off, or past retention)": 1,
    }
    known = data.known()  # type: ignore[attr-defined]
    assert (known.sum(axis=1) == 1).all()  # exactly one outcome per row
    hard_rows = np.array(["Prove" in p for p in data.prompts])  # type: ignore[attr-defined]
    weak_rows = known[:, 0]
    assert not data.weak[weak_rows & hard_rows].any() and data.weak[weak_rows & ~hard_rows].all()  # type: ignore[attr-defined]
    assert data.strong[known[:, 1]].all()  # type: ignore[attr-defined]
    # Without the master key the encrypted bodies (every fifth) cannot be read: skipped, and said so.
    _, report = _load(url, None)
    assert report.skipped["encrypted under a key this machine lacks (set WEIR_MASTER_KEY)"] == 16  # type: ignore[attr-defined]


def test_a_row_is_recorded_when_its_label_last_changed(admin_db: tuple[str, Vault]) -> None:
    url, vault = admin_db
    rescored = dt.datetime.now(dt.UTC) + dt.timedelta(days=3)
    engine = create_engine(url)
    with Session(engine) as session, session.begin():
        row = session.scalar(select(Feedback).where(Feedback.request_id == "r1"))
        assert row is not None
        created = row.created_at
        row.score, row.updated_at = 1.0 - row.score, rescored
    engine.dispose()
    data, report = _load(url, vault)
    recorded = dict(zip(data.prompts, report.recorded, strict=True))  # type: ignore[attr-defined]
    # A head trained before the new score learnt the old label: the row counts as recorded now.
    assert recorded[hard(1)] == rescored.timestamp() and created.timestamp() < rescored.timestamp()
    assert max(t for p, t in recorded.items() if p != hard(1)) < rescored.timestamp()


def test_prompt_and_candidate_extraction() -> None:
    assert request_prompt(_chat("what is up"), "chat") == "what is up"
    anthropic = {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hey"}]}],
        "system": "s",
    }
    assert request_prompt(json.dumps(anthropic), "messages") == "hey"
    assert request_prompt(json.dumps({"model": "m", "prompt": ["one"]}), "completions") == "one"
    assert request_prompt(json.dumps({"model": "m", "prompt": [1, 2]}), "completions") is None
    assert request_prompt("not json", "chat") is None
    assert request_prompt(_chat("what is up"), "embeddings") is None  # no difficulty policy scores these
    # The public name, not claude-sonnet-4-5.
    assert answered_by(ledger_row("x", 1, "t", STRONG, 200)) == STRONG


def test_partial_labels_train_a_head_that_separates_the_prompts(admin_db: tuple[str, Vault]) -> None:
    url, vault = admin_db
    data, _ = _load(url, vault)
    clf = DifficultyClassifier.default("encoder")
    head = fit_head(data, encode(clf.embedder, data.prompts), TrainConfig(epochs=30))  # type: ignore[arg-type]
    assert head.meta["weak_labelled"] == 40 and head.meta["strong_labelled"] == 40
    new = [hard(i) for i in range(100, 110)], [easy(i) for i in range(100, 110)]
    scored = DifficultyClassifier(head, clf.embedder)
    hard_scores, easy_scores = scored.score_many(new[0]), scored.score_many(new[1])
    assert min(hard_scores) > max(easy_scores)
    assert all(0.0 < p < 1.0 for p in hard_scores + easy_scores)


def test_auc_counts_ties_as_half() -> None:
    rng = np.random.default_rng(3)
    for _ in range(50):
        scores = rng.integers(0, 4, 12).astype(float)
        positive = rng.random(12) < 0.5
        pos, neg = scores[positive], scores[~positive]
        pairs = [(p > n) + 0.5 * (p == n) for p in pos for n in neg]
        if pairs:
            assert auc(scores, positive) == pytest.approx(np.mean(pairs))
        else:
            assert np.isnan(auc(scores, positive))


def test_the_holdout_check_ranks_unseen_prompts_against_a_baseline(admin_db: tuple[str, Vault]) -> None:
    url, vault = admin_db
    data, _ = _load(url, vault)
    clf = DifficultyClassifier.default("encoder")
    enc = encode(clf.embedder, data.prompts)  # type: ignore[arg-type]
    constant = forced(100.0)  # scores every prompt 1.0 exactly (float32): ranks nothing
    held, results = holdout_check(data, enc, constant, TrainConfig(epochs=30), share=0.25)
    assert 10 <= held <= 30
    # Feedback labels one model a row, so only the weak model's failures can be ranked.
    [result] = results
    assert result.outcome == "weak model wrong" and result.positives + result.negatives <= held
    assert result.baseline == 0.5 and result.trained >= 0.9
    assert result.difference[0] > 0  # the interval of the paired difference excludes zero
    assert result.routed is None  # no row carries the score it was routed by

    # Rows that do (comparisons store it) are also ranked by that score: here a head that ranked
    # every one of them backwards, on all but the first row.
    # The fit is the one above, so here and for `unseen` below the head is fitted once, without the
    # calibration folds (5 of its 6 fits): what these check is which rows are ranked, and by what.
    one_fit = TrainConfig(epochs=30, calibration_folds=0)
    routed = np.where(data.weak, 0.9, 0.1).astype(float)
    routed[0] = np.nan
    _, [again] = holdout_check(data, enc, constant, one_fit, share=0.25, routed=routed)
    assert again.routed is not None
    rows, theirs, ours = again.routed
    assert rows >= again.positives + again.negatives - 1 and theirs == 0.0 and ours >= 0.9
    assert f"on the {rows} routed with a stored score" in again.summary("shipped")

    # Every fifth held out in turn: every row ranked, by a head that did not see it.
    held_all, [crossed] = holdout_check(
        data, enc, constant, TrainConfig(epochs=30), share=0.25, cross_fit=True
    )
    known = int(data.known()[:, 0].sum())  # type: ignore[attr-defined]
    assert held_all == len(data) and crossed.positives + crossed.negatives == known  # type: ignore[arg-type]
    assert crossed.baseline == 0.5 and crossed.trained >= 0.9 and crossed.difference[0] > 0
    # Rows the baseline was trained on are not ranked: with none unseen there is nothing to decide on.
    nothing = np.zeros(len(data), dtype=bool)  # type: ignore[arg-type]
    assert holdout_check(data, enc, constant, one_fit, share=0.25, unseen=nothing)[1] == []


def test_replaying_the_head_in_use_ranks_every_row(admin_db: tuple[str, Vault]) -> None:
    url, vault = admin_db
    data, _ = _load(url, vault)
    clf = DifficultyClassifier.default("static")
    enc = encode(clf.embedder, data.prompts)  # type: ignore[arg-type]
    cfg = TrainConfig(epochs=30, calibration_folds=0)  # one fit a head: 30 heads below
    known = int(data.known()[:, 0].sum())  # type: ignore[attr-defined]
    # The head in use had every row: in each fold it is refitted exactly as the new head is, so the two
    # rank alike, and no row is left out for having been seen.
    everything = np.ones(len(data), dtype=bool)  # type: ignore[arg-type]
    _, [same] = holdout_check(data, enc, forced(100.0), cfg, 0.25, cross_fit=True, replay=everything)
    assert same.positives + same.negatives == known
    assert same.trained == same.baseline and tuple(same.difference) == (0.0, 0.0)
    # It had the first half: compared as it is, only the other half can be ranked; replayed, every row,
    # and its refits rank them as a head fitted on these rows should (the constant head ranks nothing).
    early = np.arange(len(data)) < 40  # type: ignore[arg-type]
    _, [as_is] = holdout_check(data, enc, forced(100.0), cfg, 0.25, cross_fit=True, unseen=~early)
    _, [replayed] = holdout_check(data, enc, forced(100.0), cfg, 0.25, cross_fit=True, replay=early)
    assert as_is.positives + as_is.negatives < known == replayed.positives + replayed.negatives
    assert as_is.baseline == 0.5 and replayed.baseline >= 0.9 and replayed.trained >= 0.9


def test_fold_ranks_keep_ties_tied() -> None:
    np.testing.assert_allclose(_fold_rank(np.array([0.3, 0.1, 0.3, 0.9, 0.5])), [0.375, 0, 0.375, 1, 0.75])
    np.testing.assert_allclose(_fold_rank(np.array([2.0])), [0.0])


@pytest.mark.slow
def test_cli_trains_from_the_admin_db(admin_db: tuple[str, Vault], tmp_path: Path) -> None:
    url, _ = admin_db
    out = tmp_path / "head"
    result = run([*train_acme(url), "--out", str(out)])  # once as its own process; then in this one
    assert result.returncode == 0, result.stderr
    # No WEIR_MASTER_KEY here: the 16 encrypted bodies (8 from each model) are skipped.
    assert "32 answered by the weak model, 32 by the strong one" in result.stderr
    assert (out / "difficulty_head.json").exists()
    meta = json.loads((out / "difficulty_head.json").read_text())
    assert meta["source"] == "tenant acme feedback and comparisons (weak gpt-4o-mini, strong claude-sonnet)"
    # Checked on a held-out fifth first, against the shipped head; the finding is kept in the head.
    assert "held out" in result.stderr and "weak model wrong" in result.stderr
    assert meta["holdout"]["share"] == 0.2 and meta["holdout"]["results"][0]["trained"] >= 0.9
    # What the blend weighs was chosen on the rows' cross-fitted scores, and the command says so.
    assert meta["blend_inputs"] in ("components", "components+length")
    assert f"blend: {meta['blend_inputs']} (cross-fitted AUC" in result.stderr
    assert meta["version"] == (5 if meta["blend_inputs"] == "components+length" else 4)
    lines = "\n".join(json.dumps({"prompt": p}) for p in (hard(200), easy(200))) + "\n"
    scored = cli(["router", "score", "--head", str(out)], lines)
    assert scored.returncode == 0, scored.stderr
    hard_p, easy_p = (json.loads(line)["p_strong"] for line in scored.stdout.splitlines())
    assert hard_p > easy_p

    # Served: stored in the admin DB for routes to name, exported, scored the same from the bundle.
    db = ["--database-url", url]
    installed = cli(["router", "heads", "install", "acme-v1", str(out), *db])
    assert installed.returncode == 0, installed.stderr
    shown = json.loads(installed.stdout)
    assert shown["name"] == "acme-v1" and shown["source"] == meta["source"]
    listed = cli(["router", "heads", "list", *db])
    assert [json.loads(line)["digest"] for line in listed.stdout.splitlines()] == [shown["digest"]]
    exported = cli(["router", "heads", "export", "acme-v1", "--out", str(tmp_path / "acme.safetensors"), *db])
    assert exported.returncode == 0, exported.stderr
    again = cli(["router", "score", "--head", str(tmp_path / "acme.safetensors")], lines)
    assert again.stdout == scored.stdout
    bad = cli(["router", "heads", "install", "acme-v2", str(tmp_path / "acme.safetensors.missing"), *db])
    assert bad.returncode != 0
    (tmp_path / "junk.bin").write_bytes(b"junk")
    bad = cli(["router", "heads", "install", "acme-v2", str(tmp_path / "junk.bin"), *db])
    assert bad.returncode != 0 and "nothing was stored" in bad.stderr
    # A head a route names stays; once none does, it can go.
    engine = create_engine(url)
    with Session(engine) as session:
        row = session.scalars(select(RouteRow)).one()
        row.spec = {**row.spec, "head": "acme-v1"}
        session.commit()
    refused = cli(["router", "heads", "delete", "acme-v1", *db])
    assert refused.returncode != 0 and "in use by routes" in refused.stderr
    with Session(engine) as session:
        row = session.scalars(select(RouteRow)).one()
        row.spec = {k: v for k, v in row.spec.items() if k != "head"}
        session.commit()
    assert cli(["router", "heads", "delete", "acme-v1", *db]).returncode == 0
    assert cli(["router", "heads", "list", *db]).stdout == ""


def test_cli_embeds_on_one_thread(
    admin_db: tuple[str, Vault], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One prompt a MiniLM pass is too small for a second thread, which on a busy machine only spins:
    two loaded cores embedded 150 prompts in 8 s on two threads, 0.6 s on one (routing.train.one_thread)."""
    url, _ = admin_db
    real_load, threads = routing.embed.load_embedder, []

    def load(recipe: str = routing.embed.DEFAULT_RECIPE) -> WordPieceEmbedder:
        embedder = real_load(recipe)
        real_pool = embedder.pool

        def pool(ids: list[int]) -> np.ndarray:
            threads.append(torch.get_num_threads())
            return real_pool(ids)

        embedder.pool = pool  # type: ignore[method-assign]
        return embedder

    monkeypatch.setattr(routing.embed, "load_embedder", load)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        result = cli([*train_acme(url), "--holdout", "0", "--out", str(tmp_path / "head")])
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert result.returncode == 0, result.stderr
    assert len(threads) == 64 and set(threads) == {1}  # each prompt the join kept (no master key here)
    assert after == 2  # and the process's setting put back


def test_cli_says_what_is_missing(admin_db: tuple[str, Vault]) -> None:
    # Each run stops before training: in this process, not a `weir` of its own that imports torch.
    url, _ = admin_db
    result = cli(
        ["router", "train", "--tenant", "other", "--weak", WEAK, "--strong", STRONG, "--database-url", url]
    )
    assert result.returncode != 0
    assert "no usable feedback" in result.stderr and "without a stored prompt" in result.stderr
    result = cli(["router", "train", "--tenant", "nobody", "--route", "auto", "--database-url", url])
    assert result.returncode != 0 and "no tenant named 'nobody'" in result.stderr
    result = cli(["router", "train", "--tenant", "acme", "--database-url", url])
    assert result.returncode != 0 and "--route or both --weak and --strong" in result.stderr


def test_cli_without_a_migrated_admin_db_says_so_and_creates_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no database configured, `router train --tenant` made an empty ./var/weir.db and then failed
    on "no such table": it says what is missing, pointing at `weir db upgrade`, and creates nothing."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WEIR_DATABASE_URL", raising=False)
    train = ["router", "train", "--tenant", "acme", "--route", "auto"]
    result = cli(train)
    assert result.returncode == 1
    assert "admin DB: none configured (--database-url or WEIR_DATABASE_URL)" in result.stderr
    assert "`weir db upgrade` creates its tables" in result.stderr
    assert not (tmp_path / "var").exists()
    # A SQLite file named but not there is not made either; `heads` goes the same way.
    missing = tmp_path / "typo.db"
    for args in (train, ["router", "heads", "list"]):
        result = cli([*args, "--database-url", f"sqlite:///{missing}"])
        assert result.returncode == 1 and f"admin DB: {missing} does not exist" in result.stderr
    assert not missing.exists()
    # A database that is there but was never migrated.
    empty = tmp_path / "empty.db"
    empty.touch()
    result = cli([*train, "--database-url", f"sqlite:///{empty}"])
    assert result.returncode == 1
    assert "has no tables (not migrated); `weir db upgrade` creates its tables" in result.stderr


def _store_head(url: str, name: str, head: DifficultyHead) -> None:
    data = bundle(head)
    engine = create_engine(url)
    with Session(engine) as session:
        session.add(
            DifficultyHeadRow(
                name=name,
                digest=digest(data),
                embedder=head.embedder,
                size=len(data),
                meta=head.meta,
                bundle=data,
            )
        )
        session.commit()
    engine.dispose()


def test_the_route_a_tenant_reaches(admin_db: tuple[str, Vault]) -> None:
    url, _ = admin_db
    other, mine, _ = set_routes(
        url,
        {"policy": "fixed", "candidates": [{"model": WEAK}]},  # not a difficulty route: passed over
        {**DIFFICULTY, "when": {"tenants": ["other"]}, "head": "other-v1"},
        {**DIFFICULTY, "when": {"tenants": ["acme"]}, "head": "acme-v1"},
        {**DIFFICULTY, "candidates": [{"model": STRONG}, {"model": WEAK}]},
    )[1:]
    found = reached_route(url, "acme")
    assert (found.id, found.weak, found.strong, found.head, found.exclusive) == (
        mine,
        WEAK,
        STRONG,
        "acme-v1",
        True,
    )
    assert reached_route(url, "t-acme").id == mine  # by id as well as by name
    assert reached_route(url, "other").id == other
    assert reached_route(url, None).id == other  # no tenant: the first difficulty route of the name
    set_routes(
        url,
        {**DIFFICULTY, "when": {"tenants": ["other"]}},
        {**DIFFICULTY, "when": {"tenants": ["acme", "other"]}},
    )
    found = reached_route(url, "acme")
    assert found.head is None and not found.exclusive  # serves two tenants
    set_routes(url, {**DIFFICULTY, "when": {"tenants": ["other"]}})
    with pytest.raises(ValueError, match="no difficulty route named 'auto' that tenant 'acme' reaches"):
        reached_route(url, "acme")
    with pytest.raises(ValueError, match="no tenant named 'nobody'"):
        reached_route(url, "nobody")


def _result(
    trained: float, baseline: float, low: float, high: float, outcome: str = "weak model wrong"
) -> HoldoutResult:
    return HoldoutResult(outcome, 10, 10, trained, baseline, (low, high))


def test_the_promotion_rule() -> None:
    weak_only = _result(0.8, 0.6, 0.05, 0.35)
    both = _result(0.55, 0.6, -0.2, 0.1, "needs the strong model")
    # Rows that know both outcomes decide, since those are what the route should send strong.
    assert decisive([weak_only, both]) is both and decisive([weak_only]) is weak_only and decisive([]) is None
    assert should_promote(weak_only, "significant") and should_promote(weak_only, "better")
    assert not should_promote(both, "significant") and not should_promote(both, "better")
    ahead_not_clear = _result(0.7, 0.6, -0.05, 0.25)
    assert should_promote(ahead_not_clear, "better") and not should_promote(ahead_not_clear, "significant")
    with pytest.raises(ValueError, match="unknown promotion rule"):
        should_promote(weak_only, "sometimes")


@pytest.mark.slow
@pytest.mark.usefixtures("embed_each_prompt_once")
def test_install_promotes_a_better_head_and_keeps_the_one_in_use_otherwise(
    admin_db: tuple[str, Vault], tmp_path: Path
) -> None:
    url, vault = admin_db
    # The route acme alone reaches serves a head that ranks nothing (every prompt scores ~1).
    _store_head(url, "acme-old", forced(100.0))
    [route_id] = set_routes(url, {**DIFFICULTY, "when": {"tenants": ["acme"]}, "head": "acme-old"})
    train = [*train_acme(url), "--holdout", "0.5"]  # two folds, each held out in turn: two fits a run

    first = cli([*train, "--out", str(tmp_path / "h1"), "--install", "acme-auto"])
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    assert report["installed"] and report["route_updated"], report
    assert report["incumbent"].startswith("the route's head acme-old@") and report["incumbent_auc"] == 0.5
    assert report["outcome"] == "weak model wrong" and report["auc"] >= 0.9 and report["difference"][0] > 0
    # The decision rests on every row, each ranked by a head fitted without its fifth.
    assert (
        f"every prompt held out in turn (by prompt hash, 2 fits); heads fitted without it vs {report['incumbent']}"
        in (first.stderr)
    )
    assert route_head(url, route_id) == "acme-auto"
    assert audit_rows(url) == [("create", "difficulty_head", "acme-auto"), ("update", "route", str(route_id))]

    # The next night, nothing new. The head in use ranks the rows it was fitted on better than it will
    # rank new ones, so it is not compared on them as it is: it was fitted by this recipe, so within each
    # fold it is refitted on its own rows, here every row: the same fits, the same ranking, kept.
    again = cli([*train, "--out", str(tmp_path / "h2"), "--install", "acme-auto"])
    assert again.returncode == 0, again.stderr
    kept = json.loads(again.stdout)
    assert not kept["installed"] and not kept["route_updated"], kept
    assert (
        kept["incumbent"] == f"the route's head acme-auto@{report['digest']} refitted per fold on its 64 rows"
    )
    assert "refitting it on them in each fold, every row ranked" in again.stderr
    assert kept["difference"] == [0.0, 0.0] and "not significantly better" in kept["reason"]

    # New traffic since (120 requests, 24 of them encrypted): every row is ranked by a head fitted on
    # all the others and by one fitted on what the head in use had; on rows this easy both rank
    # nearly perfectly, so the head in use stays.
    engine = create_engine(url)
    with Session(engine) as session:
        _traffic(session, vault, random.Random(1), range(80, 200))
        session.commit()
    engine.dispose()
    later = cli([*train, "--out", str(tmp_path / "h3"), "--install", "acme-auto"])
    assert later.returncode == 0, later.stderr
    kept = json.loads(later.stdout)
    assert not kept["installed"] and "not significantly better" in kept["reason"], kept
    assert kept["held_out"] == 80 and kept["auc"] >= 0.9 and kept["incumbent_auc"] >= 0.9  # weak-model rows
    # Trained by another recipe (here: other epochs), the head in use cannot be refitted as it was:
    # it is ranked as it is, on the rows recorded since it was trained.
    other = cli([*train, "--epochs", "2", "--out", str(tmp_path / "h3b"), "--install", "acme-auto"])
    assert other.returncode == 0, other.stderr
    kept = json.loads(other.stdout)
    assert not kept["installed"] and "ranking only the 96 recorded since" in other.stderr
    assert 0 < kept["held_out"] < 96
    listed = cli(["router", "heads", "list", "--database-url", url])
    digests = {json.loads(line)["name"]: json.loads(line)["digest"] for line in listed.stdout.splitlines()}
    assert digests["acme-auto"].startswith(report["digest"])
    assert len(audit_rows(url)) == 2

    # A route other tenants share is not re-pointed by one tenant's head, and a head it serves is
    # not replaced.
    [shared] = set_routes(url, {**DIFFICULTY, "head": "acme-old"})
    stored = cli([*train, "--out", str(tmp_path / "h4"), "--install", "acme-v2"])
    assert stored.returncode == 0, stored.stderr
    shown = json.loads(stored.stdout)
    assert (
        shown["installed"] and not shown["route_updated"] and "does not serve 'acme' alone" in shown["reason"]
    )
    assert route_head(url, shared) == "acme-old"
    refused = cli([*train, "--out", str(tmp_path / "h5"), "--install", "acme-old"])
    assert refused.returncode != 0 and "not only this tenant's" in refused.stderr
    assert "nothing was trained or stored" in refused.stderr and len(audit_rows(url)) == 3

    bad = cli([*train, "--install", "acme-auto", "--holdout", "0"])
    assert bad.returncode != 0 and "--holdout 0" in bad.stderr
    bad = cli(["router", "train", "--tenant", "acme", "--weak", WEAK, "--strong", STRONG, "--install", "x"])
    assert bad.returncode != 0 and "--install needs --tenant and --route" in bad.stderr


@pytest.fixture
def acme_route_db(db_url: str) -> str:
    """An admin DB, SQLite or PostgreSQL, with tenant acme and a difficulty route only acme reaches
    (strong_share 0.3, the shipped head)."""

    async def setup() -> None:
        engine = create_async_engine(db_url)
        try:
            async with engine.begin() as conn:
                await conn.run_sync(Base.metadata.create_all)
            async with sessionmaker(engine)() as session, session.begin():
                session.add(Tenant(id="t-acme", name="acme", store_prompts=True))
                spec = {"name": "auto", **DIFFICULTY, "strong_share": 0.3, "when": {"tenants": ["acme"]}}
                session.add(RouteRow(name="auto", position=0, spec=spec))
        finally:
            await engine.dispose()

    asyncio.run(setup())
    return db_url


def test_install_does_not_undo_an_admin_edit_of_the_route_made_while_it_stores_the_head(
    acme_route_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--install` checked the route was as training read it, stored the head, then rewrote the
    route's whole spec from that check's read, the row never locked: an admin's edit committed while
    the head's megabytes were written (strong_share 0.3 -> 0.5) was undone, and the report said the
    route was updated as planned. Now the route is read, locked, after the head is written: the edit
    is seen, and the install refused and rolled back, the head not stored."""
    url = acme_route_db
    route = reached_route(url, "acme")
    assert route.exclusive and route.spec is not None
    edited = json.dumps({**route.spec, "strong_share": 0.5})
    real_put_head = routing.heads.put_head

    async def put_head_while_an_admin_edits(*args: object) -> object:
        # The admin's edit, committed on a connection of its own (its own event loop: a thread).
        statement = f"UPDATE routes SET spec = '{edited}' WHERE id = {route.id}"
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(sync_exec, url, statement).result()
        return await real_put_head(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(routing.heads, "put_head", put_head_while_an_admin_edits)
    checked = {"baseline": "the shipped encoder head", "results": [_result(0.9, 0.6, 0.2, 0.4).__dict__]}
    with pytest.raises(click.ClickException) as refused:
        _promote(forced(0.0), "acme-auto", route, "acme", checked, "significant", url)
    assert f"route {route.id} changed" in refused.value.message
    assert "nothing was stored" in refused.value.message
    [(spec,)] = sync_exec(url, f"SELECT spec FROM routes WHERE id = {route.id}")
    assert (spec if isinstance(spec, dict) else json.loads(spec))["strong_share"] == 0.5
    assert sync_exec(url, "SELECT count(*) FROM difficulty_heads") == [(0,)]
    assert sync_exec(url, "SELECT count(*) FROM audit_log") == [(0,)]
