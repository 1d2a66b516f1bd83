"""`weir router score` and `weir router train`, run as a user runs them."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from routing.difficulty import DifficultyClassifier
from tests.routing.weir_command import run


def test_score_round_trip(classifier: DifficultyClassifier) -> None:
    prompts = ["What is 2 + 2?", "Explain the proof of the Cook-Levin theorem step by step."]
    lines = [json.dumps({"prompt": p}) for p in prompts]
    lines.append(
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": prompts[1]},
                ]
            }
        )
    )
    result = run(["router", "score", "--shipped", "encoder"], "\n".join(lines) + "\n")
    assert result.returncode == 0, result.stderr
    out = [json.loads(line) for line in result.stdout.splitlines()]
    assert [set(o) for o in out] == [{"p_strong"}] * 3
    expected = [classifier.score(p) for p in prompts]
    assert [o["p_strong"] for o in out] == pytest.approx([*expected, expected[1]], abs=1e-6)


def test_auto_reports_its_head_on_stderr_and_scores_with_it(classifier: DifficultyClassifier) -> None:
    prompt = "Explain the proof of the Cook-Levin theorem step by step."
    result = run(["router", "score"], json.dumps({"prompt": prompt}) + "\n")
    assert result.returncode == 0, result.stderr
    assert "difficulty_head_chosen" in result.stderr and "difficulty_head_chosen" not in result.stdout
    chosen = "encoder" if "head=encoder" in result.stderr else "static"
    assert f"head={chosen}" in result.stderr
    expected = DifficultyClassifier.default(chosen).score(prompt)
    assert json.loads(result.stdout)["p_strong"] == pytest.approx(expected, abs=1e-6)


def test_score_reports_bad_lines_in_place() -> None:
    stdin = '{"prompt": "ok"}\nnot json\n{"text": "wrong key"}\n\n{"prompt": "fine"}\n'
    result = run(["router", "score"], stdin)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    # Every line answers on its own line, the blank one with a blank line: skipped, it shifted every
    # later answer onto the line before its own (line 5's score on line 4).
    assert len(lines) == 5 and lines[3] == ""
    out = [json.loads(line) for line in lines if line]
    assert "p_strong" in out[0] and "p_strong" in out[3]
    assert out[1]["error"].startswith("line 2:")
    assert "prompt" in out[2]["error"]
    assert "2 line(s) could not be scored" in result.stderr


@pytest.fixture
def mmlu_slice(tmp_path: Path, fixture_dir: Path) -> Path:
    """The first 40 questions of each subject in `fixture_dir`, with its list of contaminated prompts
    (the first physics question is on it). The tests below check what `router train` reads and writes,
    not what the head learns (benchmarks/routing_eval.py measures that): on 80 rows, not 300, each
    fit is smaller and MiniLM embeds 160 prompts and stems, not 600."""
    out = tmp_path / "mmlu"
    out.mkdir()
    shutil.copy(fixture_dir / "contaminated_prompts.jsonl", out)
    for path in fixture_dir.glob("mmlu_*.csv"):
        with path.open(newline="") as src, (out / path.name).open("w", newline="") as dst:
            csv.writer(dst).writerows(list(csv.reader(src))[:41])  # the header and 40 rows
    return out


def test_score_takes_a_byte_order_mark_on_the_first_line() -> None:
    """A file saved by a Windows editor or PowerShell starts with a UTF-8 BOM: its first line was
    `{"error": "line 1: Unexpected UTF-8 BOM ..."}` and the run exited 1."""
    result = run(["router", "score"], '\ufeff{"prompt": "What is 2 + 2?"}\n{"prompt": "And 3 + 3?"}\n')
    assert result.returncode == 0, result.stdout + result.stderr
    assert [set(json.loads(line)) for line in result.stdout.splitlines()] == [{"p_strong"}] * 2


def test_train_then_score_with_the_new_head(tmp_path: Path, mmlu_slice: Path) -> None:
    head_dir = tmp_path / "head"
    result = run(["router", "train", "--data", str(mmlu_slice), "--out", str(head_dir), "--epochs", "1"])
    assert result.returncode == 0, result.stderr
    assert "79 prompts" in result.stderr  # 80 rows, one listed as contaminated
    meta = json.loads((head_dir / "difficulty_head.json").read_text())
    assert meta["groups"] == ["conceptual_physics", "world_religions"]
    assert meta["embedder"] == "minilm-student-3l4h384f-96tok-v1"  # the distilled encoder, by default
    scored = run(["router", "score", "--head", str(head_dir)], '{"prompt": "A ball is dropped from rest."}\n')
    assert scored.returncode == 0, scored.stderr
    assert 0.0 <= json.loads(scored.stdout)["p_strong"] <= 1.0


def test_train_on_the_static_table(tmp_path: Path, mmlu_slice: Path) -> None:
    head_dir = tmp_path / "head"
    args = ["router", "train", "--data", str(mmlu_slice), "--out", str(head_dir), "--epochs", "1"]
    result = run([*args, "--embedder", "minilm-l6-static-v1"])
    assert result.returncode == 0, result.stderr
    assert json.loads((head_dir / "difficulty_head.json").read_text())["embedder"] == "minilm-l6-static-v1"
    scored = run(["router", "score", "--head", str(head_dir)], '{"prompt": "A ball is dropped from rest."}\n')
    assert scored.returncode == 0, scored.stderr
    assert run([*args, "--embedder", "word2vec"]).returncode == 2


def test_train_rejects_bad_input(tmp_path: Path) -> None:
    assert run(["router", "train"]).returncode == 2  # neither --data nor --feedback
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run(["router", "train", "--data", str(empty), "--out", str(tmp_path / "h")])
    assert result.returncode == 1
    assert "no mmlu_<subject>.csv files" in result.stderr
    assert not (tmp_path / "h").exists()


# The C locale, not coerced to UTF-8 (PEP 538, 540): `open` decodes as ASCII, as on a server whose
# locale is unset or POSIX.
ASCII_LOCALE = {"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
LOAD = (
    "import sys; from pathlib import Path; from routing.train import load_jsonl, load_mmlu\n"
    "data = load_mmlu(Path(sys.argv[2])) if sys.argv[1] == 'mmlu' else load_jsonl(Path(sys.argv[2]))\n"
    "print(len(data), data.prompts[0].encode('unicode_escape').decode())\n"
)


@pytest.mark.parametrize("kind", ["mmlu", "feedback"])
def test_training_files_are_read_as_utf8_whatever_the_locale(tmp_path: Path, kind: str) -> None:
    """`--data` CSVs were opened in the locale's encoding (a UTF-8 prompt with an accent failed under
    an ASCII locale), and a `--feedback` file's byte order mark made its first row an error."""
    if kind == "mmlu":
        path = tmp_path / "mmlu_french.csv"
        path.write_bytes("\ufeffprompt,weak,strong\nQu'est-ce qu'un café ?,True,False\n".encode())
        target = tmp_path
    else:
        path = tmp_path / "feedback.jsonl"
        row = {"prompt": "Qu'est-ce qu'un café ?", "weak_correct": True, "strong_correct": False}
        path.write_bytes("\ufeff".encode() + json.dumps(row, ensure_ascii=False).encode() + b"\n")
        target = path
    env = {**os.environ, **ASCII_LOCALE}
    loaded = subprocess.run(
        [sys.executable, "-c", LOAD, kind, str(target)], capture_output=True, text=True, env=env, timeout=60
    )
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout == "1 Qu'est-ce qu'un caf\\xe9 ?\n"


@pytest.mark.parametrize("name", ["mmlu_french.csv", "feedback.jsonl"])
def test_train_names_the_file_and_line_that_is_not_utf8(tmp_path: Path, name: str) -> None:
    """It was `cannot read training data: 'utf-8' codec can't decode byte 0xe9 in position 40: ...`,
    with no file (of a directory of them) or line."""
    latin1 = "Qu'est-ce qu'un café ?".encode("latin-1")
    if name.endswith(".csv"):
        content = b"prompt,weak,strong\n" + latin1 + b",True,False\n"
        args = ["--data", str(tmp_path)]
    else:
        row = b'{"prompt": "fine", "weak_correct": true, "strong_correct": true}\n'
        content = row + b'{"prompt": "' + latin1 + b'", "weak_correct": true}\n'
        args = ["--feedback", str(tmp_path / name)]
    (tmp_path / name).write_bytes(content)
    result = run(["router", "train", *args, "--out", str(tmp_path / "head")])
    assert result.returncode == 1
    at = content.index("é".encode("latin-1"))
    assert result.stderr == (
        f"Error: cannot read training data: {tmp_path / name} line 2: not UTF-8 (invalid continuation byte "
        f"at byte {at})\n"
    )


def test_train_on_one_class_says_the_auc_is_undefined(tmp_path: Path) -> None:
    """No prompt needed the strong model: the cross-fitted AUC has nothing to rank, and was printed as
    "cross-fitted AUC nan"."""
    rows = [
        {"prompt": f"question {i}: what is {i} times {i + 1}?", "weak_correct": True, "strong_correct": True}
        for i in range(30)
    ]
    feedback = tmp_path / "feedback.jsonl"
    feedback.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ["router", "train", "--feedback", str(feedback), "--embedder", "minilm-l6-static-v1"]
    result = run([*args, "--out", str(tmp_path / "head")])
    assert result.returncode == 0, result.stderr
    assert "blend: components (cross-fitted AUC undefined: one class)\n" in result.stderr
    assert "nan" not in result.stderr


def test_train_refuses_an_out_it_cannot_write_before_training(tmp_path: Path) -> None:
    """`--out` under a file: a NotADirectoryError traceback once the head was trained, minutes (on a
    real data set) after the mistake could have been said, and nothing written."""
    rows = [
        {
            "prompt": f"question {i}: what is {i} times {i + 1}?",
            "weak_correct": i % 3 != 0,
            "strong_correct": True,
        }
        for i in range(30)
    ]
    feedback = tmp_path / "feedback.jsonl"
    feedback.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "file").touch()
    out = tmp_path / "file" / "head"
    args = ["router", "train", "--feedback", str(feedback), "--embedder", "minilm-l6-static-v1"]
    result = run([*args, "--out", str(out)])
    assert result.returncode == 1, result.stderr
    assert result.stderr == f"Error: --out {out}: {tmp_path / 'file'} is a file, not a directory\n"


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (
            [{"prompt": f"question {i}", "weak_correct": True, "strong_correct": True} for i in range(5)],
            "need at least 20 labelled prompts to train, got 5",
        ),
        (
            [
                {"prompt": f"question {i}", "weak_correct": None, "strong_correct": i % 2 == 0}
                for i in range(30)
            ],
            "need at least 10 prompts with the weak model's outcome, got 0",
        ),
    ],
)
def test_train_refuses_too_few_outcomes_before_encoding_them(
    tmp_path: Path, rows: list[dict[str, object]], message: str
) -> None:
    """Said once the file is read, not after loading the embedder and encoding every prompt (minutes
    for a tenant's thousands with MiniLM), and not with numpy's "need at least one array to stack"
    from a holdout check on no held-out row first."""
    feedback = tmp_path / "feedback.jsonl"
    feedback.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = run(["router", "train", "--feedback", str(feedback), "--out", str(tmp_path / "head")])
    assert result.returncode == 1, result.stderr
    assert result.stderr == f"Error: {message}\n"
    assert not (tmp_path / "head").exists()


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (
            "prompt,weak,strong\nWhat is 2+2?,True\n",
            "mmlu_maths.csv line 2: expected 3 columns (prompt, weak, strong), got 2",
        ),
        ("", "mmlu_maths.csv: empty, not even a header"),
        (
            "prompt,weak,strong\nWhat is 2+2?,True,yes\n",
            'mmlu_maths.csv line 2: outcomes must be True or False, got "True", "yes"',
        ),
    ],
)
def test_train_names_the_file_and_line_of_a_malformed_csv(tmp_path: Path, rows: str, message: str) -> None:
    """A row of two columns was `cannot read training data: not enough values to unpack (expected 3,
    got 2)`, with neither file nor line; an empty file a StopIteration traceback; an outcome other than
    True or False was read as False."""
    (tmp_path / "mmlu_maths.csv").write_text(rows)
    result = run(["router", "train", "--data", str(tmp_path), "--out", str(tmp_path / "head")])
    assert result.returncode == 1, result.stderr
    assert result.stderr == f"Error: cannot read training data: {tmp_path / message}\n"
