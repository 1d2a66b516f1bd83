"""`weir router`: score prompts with the difficulty classifier, and retrain its head.

Kept light at import time: numpy, tokenizers and torch load only inside the commands.
"""

from __future__ import annotations

import codecs
import datetime as dt
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import click

from gateway.cli import unwritable
from gateway.db.cli import database_url_option, run_on_admin_db

if TYPE_CHECKING:
    from routing.train import Outcomes

# Recipes in routing.embed (not imported here: this module loads before any command runs).
EMBEDDERS = ("minilm-student-3l4h384f-96tok-v1", "minilm-l6-first3-96tok-v1", "minilm-l6-static-v1")
PROMOTE_RULES = ("significant", "better")  # routing.train.should_promote
# The head in use is refitted per fold only when each fold would keep about this many of its rows
# (fit_head needs 20; hash folds are not exactly even).
REPLAY_MIN_ROWS = 30


def _not_nan(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    # click's FloatRange lets NaN through (every comparison with it is false); as a share or a
    # threshold it would silently turn the option off (--holdout) or label every row wrong.
    if value is not None and value != value:
        raise click.BadParameter("must be a number, not NaN")
    return value


@click.group()
def router() -> None:
    """The difficulty router: score prompts, retrain the classifier head."""


@router.command()
@click.option(
    "--head",
    "head_dir",
    type=click.Path(exists=True, path_type=Path),
    default=None,
    help="A trained head: the directory `weir router train` wrote, or a bundle file from `weir router "
    "heads export` (default: one shipped with Weir, see --shipped).",
)
@click.option(
    "--shipped",
    type=click.Choice(["auto", "encoder", "static"]),
    default="auto",
    show_default=True,
    help="Without --head: the encoder head (v4), the static-table head (v3), or auto: the encoder if "
    "it fits the 5 ms budget on this machine (timed at start, reported on stderr), as the gateway does.",
)
def score(head_dir: Path | None, shipped: str) -> None:
    """Read JSON lines {"prompt": ...} (or {"messages": [...]}, OpenAI chat shape) on stdin; write
    {"p_strong": <0..1>} per line on stdout.

    p_strong is the estimated probability that the weak model gets this prompt wrong while the strong
    model gets it right. A line that cannot be scored yields {"error": ...} in its place and the
    command exits with status 1; a blank line yields a blank line, so output lines stay aligned with
    input lines.
    """
    import structlog

    from routing.difficulty import DifficultyClassifier, HeadChoice, prompt_text

    # stdout carries one result per input line; the head choice and anything else logged go to stderr.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    if head_dir:
        from routing.heads import classifier_from_bundle, read_bundle

        try:
            # A directory is read as `heads install` reads it: one without a head, or with a
            # broken one, is an error naming it, not a traceback.
            clf = classifier_from_bundle(read_bundle(head_dir))
        except (OSError, ValueError) as exc:
            raise click.ClickException(str(exc)) from None
    else:
        clf = DifficultyClassifier.default(cast("HeadChoice", shipped))
    failed = 0
    # Bytes, decoded line by line: one line that is not UTF-8 is that line's error, not a traceback
    # that ends the run (how sys.stdin decodes depends on the locale).
    for lineno, raw in enumerate(sys.stdin.buffer, start=1):
        if lineno == 1:  # a UTF-8 byte order mark (Windows editors, PowerShell) starts the text, not a line
            raw = raw.removeprefix(codecs.BOM_UTF8)
        # A blank line in, a blank line out: skipped without a line of its own, every later answer
        # sat on the line of the input before it.
        answer = ""
        if raw.strip():
            try:
                text = _score_input(raw, prompt_text)
                out: dict[str, float | str] = {"p_strong": round(clf.score(text), 6)}
            except ValueError as exc:  # json.JSONDecodeError is a ValueError
                failed += 1
                out = {"error": f"line {lineno}: {exc}"}
            answer = json.dumps(out)
        sys.stdout.write(answer + "\n")
        sys.stdout.flush()
    if failed:
        click.echo(f"{failed} line(s) could not be scored", err=True)
        sys.exit(1)


def _score_input(line: bytes, prompt_text: Callable[[list[dict[str, Any]]], str]) -> str:
    """The text to score from one input line; ValueError saying what is wrong with it."""
    try:
        row = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except RecursionError:  # arrays nested thousands deep
        raise ValueError("JSON nested too deeply") from None
    if not isinstance(row, dict):
        raise ValueError("expected a JSON object")
    if isinstance(row.get("prompt"), str):
        text = row["prompt"]
    elif isinstance(row.get("messages"), list):
        _check_chat(row["messages"])
        text = prompt_text(row["messages"])
    else:
        raise ValueError('expected a string "prompt" or a "messages" list')
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate escape (\ud800) the tokenizer cannot take
        raise ValueError("the prompt is not valid Unicode (a lone surrogate)") from None
    return text


def _check_chat(messages: list[Any]) -> None:
    """ValueError unless `messages` is a chat the gateway's chat API takes (its own message type), with
    a user turn to score. One it refuses (content a number or an object, a role "User") has no text
    `prompt_text` can read, and was scored as the empty prompt, exit status 0."""
    import msgspec

    from gateway.types import Message

    try:
        msgspec.convert(messages, list[Message])
    except msgspec.ValidationError as exc:  # it names the place as `$[0].content`: here, messages[0]
        raise ValueError(str(exc).replace("`$", "`messages", 1)) from None
    if not any(m["role"] == "user" and m.get("content") is not None for m in messages):
        raise ValueError('messages: no "user" turn with content to score')


@router.command()
@click.option(
    "--data",
    "data_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="RouteLLM MMLU outcome directory (mmlu_<subject>.csv files).",
)
@click.option(
    "--feedback",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help='JSON lines {"prompt", "weak_correct", "strong_correct", "group"?} of your own outcomes '
    "(one of the two outcomes may be null).",
)
@click.option(
    "--tenant",
    help="Learn from this tenant's POST /v1/feedback scores and its route's comparisons (a judge's "
    "grades of both answers) in the admin DB, joined with its stored prompts (store_prompts on) and "
    "the ledger's record of which model answered.",
)
@click.option(
    "--route",
    "route_name",
    help="With --tenant: the difficulty route whose weak and strong candidates to learn.",
)
@click.option("--weak", help="With --tenant: the weak model's public name (instead of --route).")
@click.option("--strong", help="With --tenant: the strong model's public name (instead of --route).")
@database_url_option  # with --tenant
@click.option(
    "--correct-at",
    type=click.FloatRange(0.0, 1.0),  # feedback scores and scaled grades are within [0, 1]
    callback=_not_nan,
    default=0.5,
    show_default=True,
    help="With --tenant: a feedback score (or a judge's grade scaled to 0..1) at or above this counts "
    "as a correct answer.",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("var/difficulty-head"),
    show_default=True,
    help="Where to write the head (try it with `weir router score --head`, serve it with `weir router "
    "heads install`).",
)
@click.option(
    "--embedder",
    type=click.Choice(EMBEDDERS),
    default=EMBEDDERS[0],
    show_default=True,
    help="What the head reads the prompt's meaning from: a 3-layer encoder distilled from MiniLM's "
    "first layers (what the shipped head uses), MiniLM's first three layers themselves (head v4; "
    "about twice the time, the same APGR on MMLU) or the static table (~0.1 ms a prompt instead of "
    "1.5-3 ms, APGR 0.01 lower on MMLU).",
)
@click.option(
    "--epochs",
    type=click.IntRange(min=1),  # 0 read as the default, fewer failed after loading everything
    default=None,
    help="Training epochs (default: the shipped recipe's).",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--holdout",
    type=click.FloatRange(0.0, 0.5),
    callback=_not_nan,
    default=None,
    help="First fit a head without this share of the prompts (by prompt hash) and compare how it and "
    "the shipped head rank them (AUC, bootstrap interval); 0 skips it. Default: 0.2 with --tenant or "
    "--feedback, 0 with --data.",
)
@click.option(
    "--install",
    "install_as",
    metavar="NAME",
    help="With --tenant and --route: store the head as NAME in the admin DB and point the route at it, "
    "only if on the held-out prompts it ranks better than the head the route serves now (--promote-if); "
    "else keep that one. Prints one JSON line saying which: for a scheduled job.",
)
@click.option(
    "--promote-if",
    type=click.Choice(PROMOTE_RULES),
    default=PROMOTE_RULES[0],
    show_default=True,
    help="With --install: 'significant' needs the 95% interval of the paired AUC difference above zero, "
    "'better' only its point estimate.",
)
def train(
    data_dir: Path | None,
    feedback: Path | None,
    tenant: str | None,
    route_name: str | None,
    weak: str | None,
    strong: str | None,
    database_url: str | None,
    correct_at: float,
    out_dir: Path,
    embedder: str,
    epochs: int | None,
    seed: int,
    holdout: float | None,
    install_as: str | None,
    promote_if: str,
) -> None:
    """Fit the difficulty head on labelled outcomes and write it to --out."""
    if sum(x is not None for x in (data_dir, feedback, tenant)) != 1:
        raise click.UsageError("give exactly one of --data, --feedback or --tenant")
    if problem := unwritable(out_dir, directory=True):  # said now, not once the head is trained
        raise click.ClickException(f"--out {out_dir}: {problem}")
    if tenant is not None and (route_name is None) == (weak is None or strong is None):
        raise click.UsageError("with --tenant, give either --route or both --weak and --strong")
    if install_as is not None:
        from routing.heads import check_name

        if tenant is None or route_name is None:
            raise click.UsageError("--install needs --tenant and --route: the route it would serve")
        if holdout == 0:
            raise click.UsageError("--install decides on the held-out check, which --holdout 0 skips")
        try:
            check_name(install_as)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
    from dataclasses import replace

    from routing.difficulty import encode
    from routing.embed import load_embedder
    from routing.train import (
        TrainConfig,
        check_trainable,
        fit_head,
        load_jsonl,
        load_mmlu,
        one_thread,
        question_stem,
    )

    report = None  # with --tenant: what the join found, per row its routed score and when recorded
    serving = None  # with --tenant and --route: the route and the head it serves now
    try:
        if tenant is not None:
            data, source, report, serving = _tenant_outcomes(
                tenant, route_name, weak, strong, database_url, correct_at
            )
        else:
            data = load_mmlu(data_dir) if data_dir else load_jsonl(feedback)  # type: ignore[arg-type]
            source = str(data_dir or feedback)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise click.ClickException(f"cannot read training data: {exc}") from exc
    try:  # too few outcomes: said now, not after loading the embedder and encoding every prompt
        check_trainable(data)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if install_as is not None and serving is not None:  # before minutes of training, not after

        async def check(sessions: Any) -> str | None:
            async with sessions() as session:
                return await _serves_others(session, install_as, serving[0])

        if problem := run_on_admin_db(database_url, check):
            raise click.ClickException(f"{problem}; nothing was trained or stored")
    cfg = replace(TrainConfig(), seed=seed, epochs=epochs or TrainConfig.epochs)
    known = data.known()
    click.echo(
        f"{len(data)} prompts; weak accuracy {data.weak[known[:, 0]].mean():.3f} "
        f"({known[:, 0].sum()} scored), strong {data.strong[known[:, 1]].mean():.3f} ({known[:, 1].sum()} scored)",
        err=True,
    )
    embed = load_embedder(embedder)
    with one_thread():  # one prompt a pass through MiniLM
        enc = encode(embed, data.prompts)
        stems = None
        if data.groups is not None and enc.options is not None and enc.options.mean() >= 0.9:
            # Multiple-choice training data: fit the fallback for prompts asked without options.
            stems = encode(embed, [question_stem(p) for p in data.prompts])
    share = holdout if holdout is not None else (0.0 if data_dir else 0.2)
    incumbent = serving[1] if install_as is not None and serving is not None else None
    # --install decides on the check, so it holds out every fifth in turn (five fits, every row ranked).
    checked = (
        _holdout(data, enc, cfg, share, report, incumbent, install_as is not None) if share > 0 else None
    )
    try:
        head = fit_head(data, enc, cfg, stems)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    head.meta["source"] = source
    if report is not None and len(report.recorded):
        # What a later --install run needs to rank this head only on rows it never saw.
        head.meta["tenant_id"] = report.tenant_id
        head.meta["trained_through"] = float(report.recorded.max())
    if checked is not None:
        head.meta["holdout"] = checked
    if aucs := head.meta.get("blend_aucs"):
        if any(math.isnan(auc) for auc in aucs.values()):
            # Every cross-fitted row of one class (no prompt needed the strong model, or every one
            # did): there is nothing to rank, and "AUC nan" said so in no words.
            said = "undefined: one class"
        else:
            said = f"{aucs['components']:.3f} on the components, {aucs['components+length']:.3f} with the length feature"
        click.echo(f"blend: {head.meta['blend_inputs']} (cross-fitted AUC {said})", err=True)
    if head.meta.get("no_held_out_skill"):
        click.echo(
            "warning: on rows held out of its own fitting this head ranked prompts no better than chance "
            "(its p_strong stays near the base rate); collect more outcomes before routing by it",
            err=True,
        )
    try:
        head.save(out_dir)
    except OSError as exc:  # a full disk, say
        raise click.ClickException(f"--out {out_dir}: {exc}") from None
    click.echo(f"wrote {out_dir}", err=True)
    if install_as is not None:
        assert serving is not None and tenant is not None
        _promote(head, install_as, serving[0], tenant, checked, promote_if, database_url)


def _holdout(
    data: Outcomes,
    enc: Any,
    cfg: Any,
    share: float,
    report: Any = None,
    incumbent: tuple[str, Any] | None = None,
    cross_fit: bool = False,
) -> dict[str, Any] | None:
    """Print how a head fitted without a held-out share ranks it against the shipped head of the same
    embedder (or `incumbent`: a label and the head a route serves now), and against the scores the
    rows were routed by where stored; what it found, for the head's metadata (None when there were too
    few rows)."""
    from dataclasses import asdict

    from routing.difficulty import DEFAULT_HEAD_DIR, STATIC_HEAD_DIR, DifficultyHead, encode
    from routing.embed import STATIC_RECIPE, load_embedder
    from routing.train import holdout_check, one_thread

    baseline_enc, unseen, replay = None, None, None
    if incumbent is not None:
        name, baseline = incumbent
        if baseline.embedder != enc.recipe:  # it reads the prompts through another embedder
            with one_thread():
                baseline_enc = encode(load_embedder(baseline.embedder), data.prompts)
        through = baseline.meta.get("trained_through")
        if report is not None and through is not None and baseline.meta.get("tenant_id") == report.tenant_id:
            had = report.recorded <= through
            since = f"{dt.datetime.fromtimestamp(through, dt.UTC):%Y-%m-%d %H:%M:%S} UTC"
            if (
                cross_fit
                and baseline_enc is None
                and baseline.meta.get("config") == asdict(cfg)
                and had.sum() * (1 - share) >= REPLAY_MIN_ROWS
            ):
                # Fitted by this recipe on this tenant's rows up to then: refit it on them within each
                # fold, so every row is ranked by both recipes unseen (benchmarks/routing_loop.py
                # after a promotion: 2-5x narrower intervals than ranking only the rows since).
                replay = had
                click.echo(
                    f"{name} was fitted by this recipe on this tenant's rows recorded up to {since}: "
                    "refitting it on them in each fold, every row ranked",
                    err=True,
                )
                name = f"{name} refitted per fold on its {int(had.sum())} rows"
            else:
                # Fitted on this tenant's rows up to then: rank only the ones recorded since.
                unseen = ~had
                click.echo(
                    f"{name} was trained on this tenant's rows recorded up to {since}: ranking only the "
                    f"{int(unseen.sum())} recorded since",
                    err=True,
                )
    else:
        static = enc.recipe == STATIC_RECIPE
        path, name = (
            (STATIC_HEAD_DIR, "the shipped static head")
            if static
            else (DEFAULT_HEAD_DIR, "the shipped encoder head")
        )
        baseline = DifficultyHead.load(path)
    try:
        held, results = holdout_check(
            data,
            enc,
            baseline,
            cfg,
            share,
            routed=None if report is None else report.routed,
            baseline_enc=baseline_enc,
            unseen=unseen,
            cross_fit=cross_fit,
            replay=replay,
        )
    except ValueError as exc:  # too few rows left to fit on
        click.echo(f"holdout check skipped: {exc}", err=True)
        return None
    how = (
        f"every prompt held out in turn (by prompt hash, {round(1 / share)} fits); heads fitted without it"
        if cross_fit
        else f"held out {held} of {len(data)} prompts (by prompt hash); a head fitted on the rest"
    )
    click.echo(f"{how} vs {name}:", err=True)
    for result in results:
        click.echo("  " + result.summary(name), err=True)
    if not results:
        click.echo("  no held-out outcome has both right and wrong answers to rank", err=True)
    return {
        "share": share,
        "rows": held,
        "cross_fitted": cross_fit,
        "baseline": name,
        "results": [asdict(r) for r in results],
    }


async def _serves_others(session: Any, name: str, route: Any) -> str | None:
    """Why `name` may not be replaced for this tenant's `route`: replacing a head that serves anyone
    else would decide for them too."""
    from routing.heads import routes_naming

    others = [r.id for r in await routes_naming(session, name) if not (route.exclusive and r.id == route.id)]
    if others:
        return f"head {name!r} is served by routes {others}, not only this tenant's: choose another name"
    return None


async def _store_head(session: Any, name: str, data: bytes, head: Any) -> Any:
    """Store bundle `data` as head `name` (`routing.heads.put_head`), audited as the CLI's change, in
    the caller's transaction; the head's row."""
    from gateway.db.models import AuditLog
    from routing.heads import describe, put_head

    row, before = await put_head(session, name, data, head)
    session.add(
        AuditLog(
            actor="cli",
            action="update" if before else "create",
            entity="difficulty_head",
            entity_id=name,
            before=before,
            after=describe(row),
        )
    )
    return row


class _RouteChanged(Exception):
    """The route `--install` read was edited before it could be pointed at the new head."""


def _promote(
    head: Any,
    name: str,
    route: Any,
    tenant: str,
    checked: dict[str, Any] | None,
    rule: str,
    database_url: str | None,
) -> None:
    """`--install`: store `head` as `name` and point the tenant's route at it, if the held-out check
    says it ranks better than the head the route serves now; one JSON line on stdout either way."""
    import msgspec

    from gateway.admin.routes import route_json
    from gateway.db.models import AuditLog, RouteRow, utcnow
    from routing.heads import bundle, digest
    from routing.store import route_spec, row_route, stamp
    from routing.train import HoldoutResult, decisive, should_promote

    result = decisive([HoldoutResult(**r) for r in checked["results"]]) if checked else None
    data = bundle(head)
    report: dict[str, Any] = {
        "installed": False,
        "route_updated": False,
        "head": name,
        "digest": digest(data)[:12],
        "route": route.id,
        "tenant": tenant,
        "rule": rule,
        "incumbent": checked["baseline"] if checked else None,
    }
    if result is not None:
        report |= {
            "outcome": result.outcome,
            "held_out": result.positives + result.negatives,
            "auc": round(result.trained, 4),
            "incumbent_auc": round(result.baseline, 4),
            "difference": [round(x, 4) for x in result.difference],
        }
    if result is None:
        report["reason"] = (
            "the held-out prompts rank nothing yet (too few, or all of one kind): kept the route as it is"
        )
    elif not should_promote(result, rule):
        report["reason"] = (
            f"{'not significantly better' if rule == 'significant' else 'no better'} than "
            f"{report['incumbent']} on the held-out prompts: kept the route as it is"
        )
    if "reason" in report:
        click.echo(json.dumps(report))
        return

    async def work(sessions: Any) -> str | None:
        try:
            async with sessions() as session, session.begin():
                return await install(session)
        except _RouteChanged as exc:  # raised inside the transaction: rolled back, the head not stored
            return str(exc)

    async def install(session: Any) -> str | None:
        if problem := await _serves_others(session, name, route):
            return problem
        await _store_head(session, name, data, head)
        # The route is read only now, locked until this transaction commits (FOR UPDATE; on SQLite the
        # head's write above holds the database's one write lock already): an edit committed while the
        # head's megabytes were written is seen, and none can land between this check and the write
        # below. Checked before them, and the spec rewritten from that read, such an edit (an admin's
        # PUT) was silently undone, and the report said the route was updated as planned.
        row = await session.get(RouteRow, route.id, with_for_update=True, populate_existing=True)
        # Any edit, not only to its head: one that shares the route with other tenants, or changes
        # its candidates, would make this head's promotion decide what it was not trained for.
        spec = (row.spec or {}) if row is not None else None
        if spec is None or spec.get("head") != route.head or spec != (route.spec or spec):
            raise _RouteChanged(
                f"route {route.id} changed while the head was being trained or stored: run again"
            )
        report["installed"] = True
        if not route.exclusive:
            report["reason"] = (
                f"better than {report['incumbent']}; stored, but route {route.id} does not serve "
                f"{tenant!r} alone (its when.tenants), so it was left as it is: point a route "
                f"limited to {tenant!r} at head {name!r}"
            )
            return None
        if route.head != name:
            shown = route_json(row)
            row.spec = route_spec(msgspec.structs.replace(row_route(row), head=name))
            row.updated_at = await stamp(session, utcnow())
            await session.flush()
            session.add(
                AuditLog(
                    actor="cli",
                    action="update",
                    entity="route",
                    entity_id=str(row.id),
                    before=shown,
                    after=route_json(row),
                )
            )
            report["route_updated"] = True
        report["reason"] = f"better than {report['incumbent']} on the held-out prompts: serving it"
        return None

    problem = run_on_admin_db(database_url, work)
    if problem is not None:
        raise click.ClickException(f"{problem}; nothing was stored")
    click.echo(json.dumps(report))


def _tenant_outcomes(
    tenant: str,
    route_name: str | None,
    weak: str | None,
    strong: str | None,
    database_url: str | None,
    correct_at: float,
) -> tuple[Outcomes, str, Any, tuple[Any, tuple[str, Any] | None] | None]:
    """The tenant's rows, where they came from, what the join found (routing.feedback.FeedbackReport),
    and with --route the route the tenant reaches with the head it serves now (None: the shipped one)."""
    from gateway.vault import Vault, VaultError
    from routing.feedback import load_feedback, tenant_route
    from routing.heads import stored_bundle, unbundle

    async def load(sessions: Any) -> tuple[Outcomes, str, Any, tuple[Any, tuple[str, Any] | None] | None]:
        serving = None
        if route_name is None:
            assert weak is not None and strong is not None
            w, s = weak, strong
        else:
            route = await tenant_route(sessions, route_name, tenant)
            w, s = route.weak, route.strong
            incumbent = None
            if route.head is not None:
                async with sessions() as session:
                    found = await stored_bundle(session, route.head)
                if found is not None:  # else the route serves the shipped head (docs/routing.md)
                    incumbent = (f"the route's head {route.head}@{found[0][:12]}", unbundle(found[1]))
            serving = (route, incumbent)
        data, report = await load_feedback(sessions, tenant, w, s, Vault.from_env(), correct_at)
        click.echo(report.summary(), err=True)
        if not len(data):
            raise ValueError(f"tenant {tenant!r} has no usable feedback ({report.summary()})")
        routed_by = sorted({h for h in report.routed_by if h is not None})
        if routed_by:
            click.echo(f"routed by: {', '.join(routed_by)} (the scores comparisons stored)", err=True)
        return (
            data,
            f"tenant {tenant} feedback and comparisons (weak {w}, strong {s})",
            report,
            serving,
        )

    try:
        return run_on_admin_db(database_url, load)
    except VaultError as exc:  # a bad master key
        raise ValueError(str(exc)) from exc


@router.group()
def heads() -> None:
    """Trained difficulty heads in the admin DB, which difficulty routes name in `head`."""


@heads.command("install")
@click.argument("name")
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@database_url_option
def install_head(name: str, path: Path, database_url: str | None) -> None:
    """Store the head at PATH (a directory `weir router train` wrote, or a bundle file) as NAME,
    replacing any head of that name. Gateways using the admin DB pick it up within a second."""
    from routing.heads import check_name, describe, read_bundle, unbundle

    try:
        check_name(name)
        data = read_bundle(path)
    except ValueError as exc:
        raise click.ClickException(f"{exc}; nothing was stored") from None
    head = unbundle(data)

    async def work(sessions: Any) -> dict[str, Any]:
        async with sessions() as session, session.begin():
            return describe(await _store_head(session, name, data, head))

    shown = run_on_admin_db(database_url, work)
    click.echo(json.dumps(shown))


@heads.command("list")
@database_url_option
def list_heads(database_url: str | None) -> None:
    """One JSON line per stored head (name, digest, embedder, size, training source)."""
    from routing.heads import describe, listed

    async def work(sessions: Any) -> list[dict[str, Any]]:
        async with sessions() as session:
            return [describe(row) for row in await listed(session)]

    for shown in run_on_admin_db(database_url, work):
        click.echo(json.dumps(shown))


@heads.command("export")
@click.argument("name")
@click.option(
    "--out",
    "out_path",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="Bundle file to write.",
)
@database_url_option
def export_head(name: str, out_path: Path, database_url: str | None) -> None:
    """Write the stored head NAME to a bundle file (for another deployment, or `weir router score --head`)."""
    from routing.heads import stored_bundle

    if problem := unwritable(out_path, directory=False):
        raise click.ClickException(f"cannot write {out_path}: {problem}")

    async def work(sessions: Any) -> tuple[str, bytes] | None:
        async with sessions() as session:
            return await stored_bundle(session, name)

    found = run_on_admin_db(database_url, work)
    if found is None:
        raise click.ClickException(f"no difficulty head named {name!r}")
    data = found[1]
    try:
        out_path.write_bytes(data)
    except OSError as exc:
        raise click.ClickException(f"cannot write {out_path}: {exc.strerror}") from None
    click.echo(f"wrote {out_path} ({len(data)} bytes)", err=True)


@heads.command("delete")
@click.argument("name")
@database_url_option
def delete_head(name: str, database_url: str | None) -> None:
    """Delete the stored head NAME; refused while a route names it."""
    from gateway.db.models import AuditLog, DifficultyHeadRow
    from routing.heads import describe, routes_naming

    async def work(sessions: Any) -> str | None:
        async with sessions() as session, session.begin():
            row = await session.get(DifficultyHeadRow, name)
            if row is None:
                return f"no difficulty head named {name!r}"
            used_by = await routes_naming(session, name)
            if used_by:
                return f"difficulty head {name!r} is in use by routes {', '.join(str(r.id) for r in used_by)}"
            session.add(
                AuditLog(
                    actor="cli",
                    action="delete",
                    entity="difficulty_head",
                    entity_id=name,
                    before=describe(row),
                )
            )
            await session.delete(row)
            return None

    problem = run_on_admin_db(database_url, work)
    if problem is not None:
        raise click.ClickException(f"{problem}; nothing was deleted")
    click.echo(f"deleted {name}", err=True)
