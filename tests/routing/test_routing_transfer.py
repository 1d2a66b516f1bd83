"""The transfer benchmark (`benchmarks/routing_transfer.py`) reads outcome files in RouteLLM's CSV
format, whose response columns span several lines, and in the feedback JSON lines format."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.routing_transfer import load_outcomes


def test_routellm_csv_keeps_the_first_three_columns_across_multiline_responses(tmp_path: Path) -> None:
    path = tmp_path / "gsm8k_responses.csv"
    with path.open("w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(["prompt", "weak-model", "strong-model", "weak_response", "strong_response"])
        out.writerow(
            ['Tom has 3 apples, "red" ones.', "False", "True", "He has\n#### 2", "3 apples.\n\n#### 3"]
        )
        out.writerow(["What is 2 + 2?", "True", "True", " 4\n", "4"])
    data = load_outcomes(path)
    assert data.prompts == ['Tom has 3 apples, "red" ones.', "What is 2 + 2?"]
    assert data.weak.tolist() == [False, True] and data.strong.tolist() == [True, True]
    assert data.groups is None and not data.partial


def test_feedback_json_lines_are_read_as_weir_router_train_reads_them(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    rows = [
        {"prompt": "a", "weak_correct": True, "strong_correct": None},
        {"prompt": "b", "weak_correct": False, "strong_correct": True},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_outcomes(path)
    assert data.prompts == ["a", "b"] and data.partial
    assert np.array_equal(data.known(), [[True, False], [True, True]])


def test_alpaca_eval_verdicts_become_pairwise_outcomes(tmp_path: Path) -> None:
    # AlpacaEval: preference 1 = the reference (output_1, the strong model) won, 2 = the evaluated
    # model (the weak one) won, 1.5 = a draw, which counts as right for both.
    path = tmp_path / "annotations.json"
    base = {"generator_1": "gpt4_1106_preview", "generator_2": "Mixtral-8x7B-Instruct-v0.1"}
    records = [
        {**base, "instruction": "Write a haiku.", "output_1": "...", "output_2": "...", "preference": 2.0},
        {**base, "instruction": "Prove it.", "preference": 1.0},
        {**base, "instruction": "Hi", "preference": 1.5},
    ]
    path.write_text(json.dumps(records))
    data = load_outcomes(path)
    assert data.prompts == ["Write a haiku.", "Prove it.", "Hi"]
    assert data.weak.tolist() == [True, False, True] and data.strong.tolist() == [False, True, True]
    assert not data.partial

    path.write_text(json.dumps([{**base, "instruction": "x", "preference": 1.7}]))
    with pytest.raises(ValueError, match="discrete"):
        load_outcomes(path)
