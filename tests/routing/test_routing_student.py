"""Helpers of the distilled-student experiment (`benchmarks/routing_student.py`) and the per-fold
embeddings it feeds `routing_stacking.cross_fitted`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from benchmarks.routing_stacking import cross_fitted
from benchmarks.routing_student import Student, build_student, distil, encode_one_by_one, multiply_adds
from routing.difficulty import encode
from routing.minilm import MiniLMEncoder
from routing.train import TrainConfig, load_mmlu

TEXTS = [
    "The mitochondria is the powerhouse of the cell.",
    "Which of these is NOT a prime number?\nA. 2\nB. 3\nC. 9\nD. 11\nAnswer:",
    "A contract signed under duress is voidable at the option of the coerced party.",
    "hi",
    "Compute the derivative of x squared plus three x.",
    "The treaty of Westphalia ended the Thirty Years' War in 1648.",
]


def test_multiply_adds_of_head_v4s_encoder() -> None:
    # The 510 M the docs quote for three layers over 96 tokens, and a third of it for one layer.
    linear, attention = multiply_adds(3, 12, 1536)
    assert linear == 509_607_936 and attention == 3 * 2 * 96 * 96 * 384
    assert multiply_adds(1, 12, 1536)[0] * 3 == linear
    assert multiply_adds(2, 6, 384)[0] < linear / 4


def test_unpruned_student_is_minilms_first_layers() -> None:
    ref = MiniLMEncoder(max_tokens=32, num_layers=2)
    ids, mask = ref.tokenize(TEXTS)  # padded: the student must mask as the encoder does
    with torch.no_grad():
        np.testing.assert_allclose(Student(2)(ids, mask), ref.forward(ids, mask), atol=1e-5)


def test_pruned_student_keeps_the_asked_shapes_and_learns_its_target() -> None:
    torch.manual_seed(0)
    tok = MiniLMEncoder(max_tokens=32, num_layers=1)
    student = build_student(tok, TEXTS, layers=2, heads=6, ffn=384, rank_on=len(TEXTS))
    for layer in student.layers:
        assert layer.heads == 6
        assert layer.qkv.weight.shape == (3 * 6 * 32, 384) and layer.o.weight.shape == (384, 6 * 32)
        assert layer.up.weight.shape == (384, 384) and layer.down.weight.shape == (384, 384)
    target = MiniLMEncoder(max_tokens=32, num_layers=3).encode(TEXTS)
    before = encode_one_by_one(student, tok, TEXTS)
    distil(student, tok, TEXTS, target, epochs=30, lr=1e-3)
    after = encode_one_by_one(student, tok, TEXTS)
    assert (after * target.numpy()).sum(1).mean() > (before * target.numpy()).sum(1).mean() + 0.02
    # int8 (what the head would be served) stays close to the float student it came from.
    student.quantize()
    int8 = encode_one_by_one(student, tok, TEXTS)
    assert (int8 * after).sum(1).min() > 0.97


def test_an_exported_student_is_what_the_router_runs(tmp_path: Path) -> None:
    """`--export` writes the student's layers under MiniLM's names; `MiniLMEncoder(layers_file=...)`
    runs them in place of MiniLM's, with as many heads and neurons as the file holds."""
    torch.manual_seed(0)
    tok = MiniLMEncoder(max_tokens=32, num_layers=1)
    student = build_student(tok, TEXTS, layers=2, heads=4, ffn=256, rank_on=len(TEXTS))
    for layer in student.layers:  # moved off MiniLM's values, so reading MiniLM's own would show
        for param in layer.parameters():
            param.data += 0.01 * torch.randn_like(param)
    path = tmp_path / "student.safetensors"
    save_file(student.minilm_weights(), str(path))
    served = MiniLMEncoder(max_tokens=32, layers_file=path)
    assert served.num_layers == 2 and [layer[0] for layer in served.layers] == [4, 4]
    ids, mask = served.tokenize(TEXTS)
    with torch.no_grad():
        np.testing.assert_allclose(served.forward(ids, mask), student(ids, mask), atol=1e-5)
        assert not np.allclose(served.forward(ids, mask), Student(2)(ids, mask), atol=1e-3)


def test_cross_fitted_reads_each_folds_own_embeddings(fixture_dir: Path, classifier) -> None:
    data = load_mmlu(fixture_dir)
    enc = encode(classifier.embedder, data.prompts)
    fold = np.arange(len(data)) % 2
    cfg = TrainConfig(epochs=1, sparse_buckets=0, calibration_folds=0)
    same = cross_fitted(data, enc, fold, cfg, static_by_fold={0: enc.static, 1: enc.static})
    np.testing.assert_allclose(same["components"], cross_fitted(data, enc, fold, cfg)["components"])
    # Changing fold 1's embeddings changes only the scores of fold 1's rows.
    other = {0: enc.static, 1: np.roll(enc.static, 1, axis=1)}
    changed = cross_fitted(data, enc, fold, cfg, static_by_fold=other)
    np.testing.assert_allclose(changed["components"][fold == 0], same["components"][fold == 0])
    assert not np.allclose(changed["components"][fold == 1], same["components"][fold == 1])
