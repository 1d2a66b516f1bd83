"""`weir router`: score prompts with the difficulty classifier, and retrain its head.

Kept light at import time: numpy, tokenizers and torch load only inside the commands.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click


@click.group()
def router() -> None:
    """The difficulty router: score prompts, retrain the classifier head."""


@router.command()
@click.option(
    "--head",
    "head_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Directory of a trained head (default: the one shipped with Weir).",
)
def score(head_dir: Path | None) -> None:
    """Read JSON lines {"prompt": ...} (or {"messages": [...]}, OpenAI chat shape) on stdin; write
    {"p_strong": <0..1>} per line on stdout.

    p_strong is the estimated probability that the weak model gets this prompt wrong while the strong
    model gets it right. A line that cannot be scored yields {"error": ...} in its place (so output
    lines stay aligned with input lines) and the command exits with status 1.
    """
    from routing.difficulty import DifficultyClassifier, prompt_text

    clf = DifficultyClassifier.load(head_dir) if head_dir else DifficultyClassifier.default()
    failed = 0
    for lineno, line in enumerate(sys.stdin, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("expected a JSON object")
            if isinstance(row.get("prompt"), str):
                text = row["prompt"]
            elif isinstance(row.get("messages"), list):
                text = prompt_text(row["messages"])
            else:
                raise ValueError('expected a string "prompt" or a "messages" list')
            out = {"p_strong": round(clf.score(text), 6)}
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            failed += 1
            out = {"error": f"line {lineno}: {exc}"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
    if failed:
        click.echo(f"{failed} line(s) could not be scored", err=True)
        sys.exit(1)


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
    help='JSON lines {"prompt", "weak_correct", "strong_correct", "group"?} of your own outcomes.',
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("var/difficulty-head"),
    show_default=True,
    help="Where to write the head (use it with `weir router score --head`).",
)
@click.option("--epochs", type=int, default=None, help="Training epochs (default: the shipped recipe's).")
@click.option("--seed", type=int, default=0, show_default=True)
def train(data_dir: Path | None, feedback: Path | None, out_dir: Path, epochs: int | None, seed: int) -> None:
    """Fit the difficulty head on labelled outcomes and write it to --out."""
    if (data_dir is None) == (feedback is None):
        raise click.UsageError("give exactly one of --data or --feedback")
    from dataclasses import replace

    from routing.difficulty import encode
    from routing.embed import StaticEmbedder
    from routing.train import TrainConfig, fit_head, load_jsonl, load_mmlu

    try:
        data = load_mmlu(data_dir) if data_dir else load_jsonl(feedback)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise click.ClickException(f"cannot read training data: {exc}") from exc
    cfg = replace(TrainConfig(), seed=seed, **({"epochs": epochs} if epochs else {}))
    click.echo(
        f"{len(data)} prompts; weak accuracy {data.weak.mean():.3f}, strong {data.strong.mean():.3f}",
        err=True,
    )
    embedder = StaticEmbedder.from_minilm()
    try:
        head = fit_head(data, encode(embedder, data.prompts), cfg)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    head.meta["source"] = str(data_dir or feedback)
    head.save(out_dir)
    click.echo(f"wrote {out_dir}", err=True)
