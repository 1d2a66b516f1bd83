"""The tiny slice of MMLU in tests/routing/data, for the tests that score known prompts."""

from __future__ import annotations

import csv
from pathlib import Path


def fixture_prompts(fixture_dir: Path, subject: str) -> list[str]:
    """The questions of the slice of MMLU's `subject` in `fixture_dir` (the `fixture_dir` fixture)."""
    with (fixture_dir / f"mmlu_{subject}.csv").open(newline="") as fh:
        return [row[0] for row in list(csv.reader(fh))[1:]]
