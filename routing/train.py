"""Training the difficulty head: `weir router train`.

Data: rows of (prompt, weak model correct, strong model correct, optional group). The shipped default
learns from the RouteLLM MMLU outcomes (`load_mmlu`), where the group is the MMLU subject; a tenant can
refit from its own outcome feedback as JSON lines (`load_jsonl`).

The head is a small multi-task network over a learned bag of the prompt's tokens and its MiniLM
embedding (see `routing.embed`; the embedder's recipe is recorded in the head): one shared hidden layer, then (a) the group posterior and (b) the probabilities that the weak and the
strong model answer correctly. Groups are cheap, clean supervision: "which MMLU subject is this"
is far easier to learn than "will Mixtral miss this one", and each subject's strong-minus-weak gain is
the single strongest signal in the data. Beside the network, a sparse part (TF-IDF over WordPiece uni-
and bigrams, two logistic regressions) scores P(strong right) - P(weak right) from exact word pairs.
The scores are blended with equal weight (each scaled to unit spread) and calibrated into `p_strong`:
the probability that this prompt is one the weak model gets wrong and the strong model gets right.
Both the spread and the calibration are fitted on cross-fitted scores (`TrainConfig.calibration_folds`
extra heads, each scoring the rows it was not trained on): on its own training rows the sparse part
looks far better than it is, which made the version 2 head over-confident at the top.
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import io
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from routing.difficulty import (
    HEAD_VERSION,
    LENGTH_VERSION,
    DifficultyHead,
    Encoded,
    fallback_features,
    ngram_features,
    with_length,
)
from routing.embed import VOCAB_SIZE
from routing.ranking import auc, auc_interval, mid_ranks


@dataclass
class Outcomes:
    """Per-prompt outcomes of a weak and a strong model."""

    prompts: list[str]
    weak: np.ndarray  # bool: the weak model answered correctly
    strong: np.ndarray  # bool: the strong model answered correctly
    groups: list[str] | None = None  # e.g. the MMLU subject; None when the data has none
    # Which outcomes are known (None: all). Feedback on live traffic scores only the model that
    # answered, so such rows know one of the two.
    weak_known: np.ndarray | None = None
    strong_known: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def partial(self) -> bool:
        """Whether some row lacks one of the two outcomes."""
        return any(k is not None and not k.all() for k in (self.weak_known, self.strong_known))

    def known(self) -> np.ndarray:
        """(n, 2) bool: whether the weak and the strong outcome of each row are known."""
        n = len(self.prompts)
        return np.stack(
            [
                self.weak_known if self.weak_known is not None else np.ones(n, bool),
                self.strong_known if self.strong_known is not None else np.ones(n, bool),
            ],
            axis=1,
        )

    def subset(self, idx: np.ndarray) -> Outcomes:
        groups = [self.groups[i] for i in idx] if self.groups is not None else None
        return Outcomes(
            [self.prompts[i] for i in idx],
            self.weak[idx],
            self.strong[idx],
            groups,
            self.weak_known[idx] if self.weak_known is not None else None,
            self.strong_known[idx] if self.strong_known is not None else None,
        )


def read_utf8(path: Path) -> str:
    """A training file's text: UTF-8, whatever the locale (which `open` would decode by), a leading
    byte order mark skipped (Excel's "CSV UTF-8", PowerShell's files); ValueError naming the file and
    line of bytes that are not UTF-8."""
    data = path.read_bytes()
    skip = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as exc:
        at = skip + exc.start  # in the file
        line = data.count(b"\n", 0, at) + 1
        raise ValueError(f"{path} line {line}: not UTF-8 ({exc.reason} at byte {at})") from None


def load_mmlu(data_dir: Path, drop_contaminated: bool = True) -> Outcomes:
    """The RouteLLM MMLU outcome files: `mmlu_<subject>.csv` (prompt, weak, strong columns).

    Prompts listed in `contaminated_prompts.jsonl` overlap RouteLLM's own training data and are dropped.
    """
    data_dir = Path(data_dir)
    contaminated: set[str] = set()
    path = data_dir / "contaminated_prompts.jsonl"
    if drop_contaminated and path.exists():
        contaminated = {json.loads(line)["eval_prompt"] for line in read_utf8(path).splitlines() if line}
    prompts, weak, strong, groups = [], [], [], []
    files = sorted(data_dir.glob("mmlu_*.csv"))
    if not files:
        raise FileNotFoundError(f"no mmlu_<subject>.csv files in {data_dir}")
    for file in files:
        subject = file.stem.removeprefix("mmlu_")
        with io.StringIO(read_utf8(file), newline="") as fh:
            reader = csv.reader(fh)
            if next(reader, None) is None:  # header: prompt, <weak model>, <strong model>
                raise ValueError(f"{file}: empty, not even a header")
            for row in reader:
                # Named by file and line: a short row was "not enough values to unpack", and an
                # outcome other than True or False was read as False.
                where = f"{file} line {reader.line_num}"
                if len(row) != 3:
                    raise ValueError(f"{where}: expected 3 columns (prompt, weak, strong), got {len(row)}")
                prompt, w, s = row
                if {w, s} - {"True", "False"}:
                    raise ValueError(f'{where}: outcomes must be True or False, got "{w}", "{s}"')
                if prompt in contaminated:
                    continue
                prompts.append(prompt)
                weak.append(w == "True")
                strong.append(s == "True")
                groups.append(subject)
    return Outcomes(prompts, np.array(weak), np.array(strong), groups)


def load_jsonl(path: Path) -> Outcomes:
    """Feedback rows `{"prompt", "weak_correct", "strong_correct", "group"?}`, one JSON object a line.

    An outcome may be null (or absent) when only the other model's answer was scored, but not both.
    """
    lines = [line for line in read_utf8(Path(path)).splitlines() if line.strip()]
    rows = [_feedback_row(line, n) for n, line in enumerate(lines, start=1)]
    if not rows:
        raise ValueError(f"{path} holds no rows")
    weak_known = np.array([r.get("weak_correct") is not None for r in rows])
    strong_known = np.array([r.get("strong_correct") is not None for r in rows])
    if not (weak_known | strong_known).all():
        line = int(np.argmin(weak_known | strong_known)) + 1
        raise ValueError(f"row {line}: neither weak_correct nor strong_correct is given")
    has_groups = all("group" in r for r in rows)
    return Outcomes(
        [r["prompt"] for r in rows],
        np.array([bool(r.get("weak_correct")) for r in rows]),
        np.array([bool(r.get("strong_correct")) for r in rows]),
        [str(r["group"]) for r in rows] if has_groups else None,
        None if weak_known.all() else weak_known,
        None if strong_known.all() else strong_known,
    )


def _feedback_row(line: str, n: int) -> dict[str, Any]:
    """One row of `load_jsonl`; ValueError naming the row and the key. Checked here, not where the row
    is used: a list there was a traceback, a numeric prompt one from the tokenizer, and the string
    "false" an outcome counted as correct."""
    try:
        row = json.loads(line)
    except ValueError as exc:
        raise ValueError(f"row {n}: {exc}") from None
    if not isinstance(row, dict):
        raise ValueError(f'row {n}: expected a JSON object {{"prompt", "weak_correct", "strong_correct"}}')
    if not isinstance(row.get("prompt"), str):
        raise ValueError(f'row {n}: "prompt" must be a string')
    for key in ("weak_correct", "strong_correct"):
        if row.get(key) not in (None, True, False):  # 1 and 0 are True and False here
            raise ValueError(f'row {n}: "{key}" must be true, false or null, not {row[key]!r}')
    return row


def prompt_fold(prompt: str, folds: int) -> int:
    """A stable fold for a prompt: the same text always lands in the same fold, on every machine."""
    return int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") % folds


@dataclass(frozen=True)
class TrainConfig:
    bag_dim: int = 32
    hidden: int = 256
    epochs: int = 10
    batch_size: int = 256
    lr: float = 3e-3
    weight_decay: float = 1e-4
    dropout: float = 0.1
    seed: int = 0
    # The sparse n-gram part: hash buckets (unigrams keep their WordPiece id, bigrams are hashed above
    # the vocabulary) and the inverse L2 strength of its logistic regressions (scikit-learn's C);
    # 0 buckets leaves it out.
    sparse_buckets: int = 1 << 18
    sparse_c: float = 2.0
    # The blend and its calibration into p_strong are fitted on cross-fitted component scores: this
    # many heads, each trained without one fold of the rows, score the fold they did not see. Fitted
    # on the training rows instead (0), both trust the sparse part, which nearly memorises its rows,
    # and p_strong comes out over-confident at the top.
    calibration_folds: int = 5
    # The group term's gains (needs calibration_folds >= 2 and groups; 0 leaves it off, the v3 recipe):
    # a ridge regression (this strength) of each row's gain on its cross-fitted group posterior, in
    # place of each group's mean gain. The posterior is 66% right on MMLU and its mistakes are not
    # random (college vs high-school maths); the ridge map learns what a posterior means for the gain,
    # confusions included. Off by default: +0.003 APGR when stacked across outer folds, but only
    # +0.0005 (0.693 vs 0.692) evaluated nested as shipped (`routing_eval.py --group-ridge 1`).
    group_ridge: float = 0.0
    # The fallback for prompts without answer options (`DifficultyHead.fallback`): fitted on the
    # training prompts' question stems, cross-fitted over this many folds of whole groups, when
    # `fit_head` is given the stems (`weir router train` does so for multiple-choice data); 0: none.
    fallback_folds: int = 5
    # What the blend weighs (head version 5): "components", "components+length" (the length feature
    # beside them, with the same weight), or "auto": whichever ranks the training rows better on their
    # cross-fitted scores (`blend_aucs`; needs calibration_folds >= 2, else "components"). Where length
    # carries what the components miss (real GSM8K outcomes, docs/benchmarks.md) it lifts a head fitted
    # on 250-1,000 of them by about 0.03-0.04 APGR; where the components already hold the difficulty
    # (MMLU, subjects known) it would cost 0.01, which the cross-fitted scores show, so there it stays
    # out.
    blend_inputs: str = "auto"


@contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread for the duration. Training's passes are small (one prompt through MiniLM,
    a batch of a few hundred rows): one thread is as fast as several, and several spin against each
    other on a busy machine (embedding 150 MMLU prompts on 2 loaded cores: 8 s on two threads, 0.6 s
    on one, the same embeddings bit for bit). Process-wide: for the CLI and training, not for code
    that scores from worker threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _fit_network(
    enc: Encoded,
    weak: np.ndarray,
    strong: np.ndarray,
    known: np.ndarray,
    group_ids: np.ndarray | None,
    n_groups: int,
    cfg: TrainConfig,
) -> dict[str, np.ndarray]:
    with one_thread():
        return _train_loop(enc, weak, strong, known, group_ids, n_groups, cfg)


def _train_loop(
    enc: Encoded,
    weak: np.ndarray,
    strong: np.ndarray,
    known: np.ndarray,
    group_ids: np.ndarray | None,
    n_groups: int,
    cfg: TrainConfig,
) -> dict[str, np.ndarray]:
    torch.manual_seed(cfg.seed)
    dense = torch.from_numpy(np.concatenate([enc.length[:, None], enc.static], axis=1, dtype=np.float32))
    ids = [torch.tensor(i, dtype=torch.long) for i in enc.token_ids]
    targets = torch.from_numpy(np.stack([weak, strong], axis=1).astype(np.float32))
    # Each output learns only from the rows that label it (feedback scores one model's answer).
    mask = torch.from_numpy(known.astype(np.float32))
    gt = torch.from_numpy(group_ids) if group_ids is not None else None
    bag = torch.nn.EmbeddingBag(VOCAB_SIZE, cfg.bag_dim, mode="mean")
    torch.nn.init.normal_(bag.weight, std=0.1)
    hidden = torch.nn.Linear(cfg.bag_dim + dense.shape[1], cfg.hidden)
    out = torch.nn.Linear(cfg.hidden, 2 + n_groups)
    params = [*bag.parameters(), *hidden.parameters(), *out.parameters()]
    # fused: one kernel for the whole update, 3.7x faster than the default over the 1M-weight bag (the
    # step, not the forward pass, dominated fitting heads on a few hundred feedback rows).
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    gen = torch.Generator().manual_seed(cfg.seed)
    steps = cfg.epochs * ((len(ids) + cfg.batch_size - 1) // cfg.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=steps)
    for _ in range(cfg.epochs):
        for batch in torch.randperm(len(ids), generator=gen).split(cfg.batch_size):
            rows = [ids[i] for i in batch.tolist()]
            offsets = torch.tensor([0, *np.cumsum([len(r) for r in rows[:-1]])], dtype=torch.long)
            x = torch.cat([bag(torch.cat(rows), offsets), dense[batch]], dim=1)
            h = F.dropout(F.gelu(hidden(x), approximate="tanh"), cfg.dropout, training=True)
            logits = out(h)
            bce = F.binary_cross_entropy_with_logits(logits[:, :2], targets[batch], reduction="none")
            loss = (bce * mask[batch]).sum() / mask[batch].sum().clamp(min=1.0)
            if gt is not None:
                loss = loss + F.cross_entropy(logits[:, 2:], gt[batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    tensors = {"bag": bag.weight, "w1": hidden.weight, "b1": hidden.bias, "w2": out.weight, "b2": out.bias}
    return {k: v.detach().numpy().copy() for k, v in tensors.items()}


def _fit_sparse(
    enc: Encoded, weak: np.ndarray, strong: np.ndarray, known: np.ndarray, cfg: TrainConfig
) -> dict[str, np.ndarray]:
    """TF-IDF (sublinear counts, smoothed idf, L2-normalised rows: scikit-learn's TfidfTransformer)
    over WordPiece uni- and bigrams, then a logistic regression per model (weak right, strong right),
    each on the rows that label it. Buckets no training prompt has get idf 0: at scoring time they
    drop out, as words outside a fitted vocabulary do."""
    buckets = cfg.sparse_buckets
    rows, cols, vals = [], [], []
    for row, ids in enumerate(enc.token_ids):
        index, tf = ngram_features(ids, buckets)
        rows.append(np.full(len(index), row))
        cols.append(index)
        vals.append(tf)
    r, c, v = np.concatenate(rows), np.concatenate(cols), np.concatenate(vals)
    n = len(enc)
    df = np.bincount(c, minlength=buckets)
    idf = np.where(df > 0, np.log((1 + n) / (1 + df)) + 1, 0.0)
    v = v * idf[c]
    norms = np.sqrt(np.bincount(r, weights=v * v, minlength=n))
    v = v / np.maximum(norms[r], 1e-9)
    # Only the buckets some training row has are fitted: the others get no gradient but the penalty's,
    # so they stay at zero, and L-BFGS over all 2^18 would spend its time on them (a few hundred
    # feedback rows use a few thousand buckets).
    used = np.nonzero(df)[0]
    # Unchecked, and said so (else torch warns on every call): every index is in range by construction
    # (rows from enumerate, the columns the buckets some row uses), and the check cost more than
    # building the tensor, once per fold head.
    x = torch.sparse_coo_tensor(
        torch.from_numpy(np.stack([r, np.searchsorted(used, c)])),
        torch.from_numpy(v.astype(np.float32)),
        (n, len(used)),
        check_invariants=False,
    ).coalesce()
    y = torch.from_numpy(np.stack([weak, strong], axis=1).astype(np.float32))
    mask = torch.from_numpy(known.astype(np.float32))
    counts = mask.sum(dim=0).clamp(min=1.0)
    w = torch.zeros(len(used), 2, requires_grad=True)
    b = torch.zeros(2, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=300, tolerance_grad=1e-6, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        logits = torch.sparse.mm(x, w) + b
        bce = F.binary_cross_entropy_with_logits(logits, y, reduction="none")
        # Mean loss per model plus ||w||^2 / (2 C n): scikit-learn's C * sum(loss) + ||w||^2 / 2, scaled.
        loss = ((bce * mask).sum(dim=0) / counts).sum()
        loss = loss + ((w * w).sum(dim=0) / (2 * cfg.sparse_c * counts)).sum()
        loss.backward()
        return loss

    with one_thread():
        opt.step(closure)
    sparse_w = np.zeros((buckets, 2), np.float32)
    sparse_w[used] = w.detach().numpy()
    return {
        "idf": idf.astype(np.float32),
        "sparse_w": sparse_w,
        "sparse_b": b.detach().numpy().copy(),
    }


def _group_gain(
    group_ids: np.ndarray, gain: np.ndarray, n_groups: int, prior_rows: float = 20.0
) -> np.ndarray:
    """Mean strong-minus-weak gain per group, shrunk towards the overall mean (small groups are noisy)."""
    overall = float(gain.mean())
    sums = np.bincount(group_ids, weights=gain, minlength=n_groups)
    counts = np.bincount(group_ids, minlength=n_groups)
    return ((sums + prior_rows * overall) / (counts + prior_rows)).astype(np.float32)


def ridge_group_gain(posterior: np.ndarray, gain: np.ndarray, alpha: float) -> np.ndarray:
    """Per-group gains g minimising |gain - posterior @ g|^2 + alpha |g - mean(g)|^2 (least squares
    with an unpenalised intercept: as the posterior sums to 1, the intercept folds into every g)."""
    x_mean, y_mean = posterior.mean(axis=0), gain.mean()
    x = posterior - x_mean
    coef = np.linalg.solve(x.T @ x + alpha * np.eye(x.shape[1]), x.T @ (gain - y_mean))
    return (coef + (y_mean - x_mean @ coef)).astype(np.float32)


# The smallest Platt slope `fit_blend` keeps (per unit of the summed, unit-spread components).
MIN_BLEND_SLOPE = 1e-3


def unit_scale(components: np.ndarray) -> np.ndarray:
    """Per column, what scales it to unit spread (the blend sums its inputs with equal weight so)."""
    return 1.0 / np.maximum(components.std(axis=0), 1e-6)


def fit_blend(components: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Blend weights of the components and a bias, from cross-fitted component scores (see
    `cross_fitted_components`): each component is scaled to unit spread and they are summed with
    equal weight, then Platt scaling (a 1-D logistic regression of `target`, 0/1 or a probability)
    maps the sum to p_strong.

    Equal weights, not fitted ones: weights fitted to P(weak wrong and strong right), or by least
    squares to the gain, ranked held-out folds worse (cross-fitted APGR 0.687 and 0.690 against 0.693
    for equal weights), as the components are strongly correlated and their fitted weights unstable.
    """
    scale = unit_scale(components)
    if np.ptp(target) == 0:
        # Rows all of one kind (every one needed the strong model, or none did): there is nothing to
        # rank, and Platt's optimum lies at infinity (the fit below returned NaN, or weights of 1e6).
        # No skill: every prompt scores the base rate, with a pseudo-row of each kind.
        rate = (float(target.sum()) + 1.0) / (len(target) + 2.0)
        return np.array([*np.zeros_like(scale), np.log(rate / (1.0 - rate))], dtype=np.float32)
    x = torch.from_numpy((components @ scale).astype(np.float64))
    y = torch.from_numpy(target.astype(np.float64))
    w = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=100, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(w[0] * x + w[1], y)
        loss.backward()
        return loss

    opt.step(closure)
    slope, bias = w.detach().tolist()
    if slope < MIN_BLEND_SLOPE:
        # Cross-fitted scores that rank the rows backwards (a few hundred rows can, by chance) must
        # not turn the head upside down: every component is built so that higher means "needs the
        # strong model". Keep the head's own order with a slope near zero, so p_strong stays near the
        # base rate: "no skill shown on held-out rows", not "easy is hard".
        w = torch.tensor([MIN_BLEND_SLOPE, bias], dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS([w], max_iter=100, line_search_fn="strong_wolfe")

        def bias_only() -> torch.Tensor:
            opt.zero_grad()
            loss = F.binary_cross_entropy_with_logits(MIN_BLEND_SLOPE * x + w[1], y)
            loss.backward()
            return loss

        opt.step(bias_only)
        slope, bias = MIN_BLEND_SLOPE, float(w[1].detach())
    return np.array([*(slope * scale), bias], dtype=np.float32)


BLEND_INPUTS = ("components", "components+length")


def blend_columns(components: np.ndarray, length: np.ndarray, inputs: str) -> np.ndarray:
    """The columns the blend is fitted on for `inputs` (one of `BLEND_INPUTS`)."""
    return components if inputs == "components" else with_length(components, length)


def blend_aucs(components: np.ndarray, length: np.ndarray, data: Outcomes) -> dict[str, float]:
    """How well each choice of `BLEND_INPUTS`, blended as `fit_blend` does (equal weights on unit
    spreads), ranks the rows from their cross-fitted `components`: AUC for "weak wrong and strong
    right" where every row has both outcomes; with feedback rows (one outcome each), AUC for "weak
    wrong" over the rows whose weak outcome is known, the only observed sign of a prompt the weak
    model cannot do."""
    rows = data.known()[:, 0] if data.partial else np.ones(len(data), bool)
    target = ~data.weak[rows] if data.partial else ~data.weak & data.strong
    out = {}
    for inputs in BLEND_INPUTS:
        x = blend_columns(components, length, inputs)
        out[inputs] = auc((x @ unit_scale(x))[rows], target)
    return out


def _fit_parts(data: Outcomes, enc: Encoded, cfg: TrainConfig) -> DifficultyHead:
    """The network, the sparse part and the group gains, with an unfitted (zero) blend."""
    known = data.known()
    groups = sorted(set(data.groups)) if data.groups is not None else []
    group_ids = np.array([groups.index(g) for g in data.groups]) if data.groups is not None else None
    gain = data.strong.astype(np.float32) - data.weak.astype(np.float32)
    # DifficultyHead's array fields by name; typed Any so they can be passed as its keywords.
    net: dict[str, Any] = _fit_network(enc, data.weak, data.strong, known, group_ids, len(groups), cfg)
    if cfg.sparse_buckets:
        net |= _fit_sparse(enc, data.weak, data.strong, known, cfg)
    group_gain = (
        _group_gain(group_ids, gain, len(groups)) if group_ids is not None else np.zeros(0, np.float32)
    )
    width = 3 if cfg.sparse_buckets else 2
    return DifficultyHead(**net, group_gain=group_gain, blend=np.zeros(width + 1, np.float32))


def calibration_target(data: Outcomes, correct: np.ndarray) -> np.ndarray:
    """What p_strong is calibrated to: the observed "weak wrong and strong right" when every row has
    both outcomes, else the estimate P(strong right)(1 - P(weak right)) from `correct` ((n, 2))."""
    if data.partial:
        return correct[:, 1] * (1 - correct[:, 0])
    return (~data.weak & data.strong).astype(np.float64)


def cross_fitted_components(
    data: Outcomes, enc: Encoded, cfg: TrainConfig, folds: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Component scores, network P(right) and group posterior of every row from a head trained
    without its fold (folds by prompt hash): (n, components), (n, 2), (n, groups). A fold head that
    lacks a group gives it posterior 0."""
    fold = np.array([prompt_fold(p, folds) for p in data.prompts])
    groups = sorted(set(data.groups)) if data.groups is not None else []
    components: np.ndarray | None = None
    correct = np.zeros((len(data), 2))
    posterior = np.zeros((len(data), len(groups)))
    for k in range(folds):
        train, test = np.nonzero(fold != k)[0], np.nonzero(fold == k)[0]
        if not len(test):
            continue
        parts = _fit_parts(data.subset(train), enc.subset(train), cfg)
        held_out = enc.subset(test)
        c = parts.components(held_out)
        if components is None:
            components = np.zeros((len(data), c.shape[1]))
        components[test] = c
        correct[test] = parts.correct(held_out)
        if groups:
            assert data.groups is not None  # groups is empty without them
            seen = sorted({data.groups[i] for i in train})
            posterior[np.ix_(test, np.searchsorted(groups, seen))] = parts.group_posterior(held_out)
    assert components is not None
    return components, correct, posterior


def question_stem(prompt: str) -> str:
    """A multiple-choice prompt without its answer options and the trailing "Answer:": the question as
    a chat user would ask it."""
    head, sep, _ = prompt.rpartition("\nA. ")
    stem = head if sep else prompt
    return stem.removesuffix("Answer:").rstrip()


def group_folds(groups: list[str], folds: int) -> np.ndarray:
    """Folds of whole groups (e.g. MMLU subjects), shuffled with a fixed seed."""
    names = sorted(set(groups))
    rng = np.random.default_rng(0)
    fold_of = {g: i % folds for i, g in enumerate(rng.permutation(names))}
    return np.array([fold_of[g] for g in groups])


def _logistic(x: np.ndarray, y: np.ndarray, c: float = 1.0) -> np.ndarray:
    """L2-regularised logistic regression with an unpenalised intercept (scikit-learn's objective,
    C = c): the weights, then the bias."""
    xt = torch.from_numpy(x.astype(np.float64))
    yt = torch.from_numpy(y.astype(np.float64))
    w = torch.zeros(x.shape[1] + 1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=200, tolerance_grad=1e-9, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(xt @ w[:-1] + w[-1], yt, reduction="sum")
        loss = loss + (w[:-1] ** 2).sum() / (2 * c)
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach().numpy().astype(np.float32)


def fit_fallback(data: Outcomes, enc: Encoded, stems: Encoded, cfg: TrainConfig) -> np.ndarray:
    """The fallback for prompts without answer options: a logistic regression of "weak wrong and
    strong right" on `fallback_features` of each row's question stem (`stems`), scored twice: by a
    head trained on the full prompts (`enc`) of other rows (folds by prompt hash: a subject it knows)
    and by one trained on the other groups only (folds of whole groups: a subject it never saw);
    `cfg.fallback_folds` folds each.

    What it learns is what of the head carries to questions asked without options, and that the
    subject terms deserve trust only as far as the head is sure of the subject: on MMLU stems of unseen
    subjects they point the wrong way, on stems of known ones the right way."""
    assert data.groups is not None
    x, y = [], []
    for fold in (
        np.array([prompt_fold(p, cfg.fallback_folds) for p in data.prompts]),
        group_folds(data.groups, min(cfg.fallback_folds, len(set(data.groups)))),
    ):
        rows = np.zeros((len(data), 0))
        for k in np.unique(fold):
            train, test = np.nonzero(fold != k)[0], np.nonzero(fold == k)[0]
            head = _fit_parts(data.subset(train), enc.subset(train), cfg)
            held_out = stems.subset(test)
            c, confidence = head.components_and_confidence(held_out)
            f = fallback_features(c, held_out.length, confidence)
            if not rows.shape[1]:
                rows = np.zeros((len(data), f.shape[1]))
            rows[test] = f
        x.append(rows)
        y.append(~data.weak & data.strong)
    return _logistic(np.concatenate(x), np.concatenate(y))


def check_trainable(data: Outcomes) -> None:
    """ValueError unless `fit_head` can fit `data`: cheap, for a caller to check before it encodes the
    prompts (minutes for thousands with MiniLM)."""
    if len(data) < 20:
        raise ValueError(f"need at least 20 labelled prompts to train, got {len(data)}")
    known = data.known()
    for column, name in enumerate(("weak", "strong")):
        if known[:, column].sum() < 10:
            raise ValueError(
                f"need at least 10 prompts with the {name} model's outcome, got {known[:, column].sum()}"
            )
    if data.partial and data.groups is not None:
        raise ValueError("groups need both outcomes on every row (a group's gain is strong minus weak)")


def fit_head(
    data: Outcomes, enc: Encoded, cfg: TrainConfig | None = None, stems: Encoded | None = None
) -> DifficultyHead:
    """Train a head on `data`, whose prompts `enc` encodes (see `routing.difficulty.encode`).

    With partially labelled rows (`Outcomes.partial`: live feedback scores only the model that
    answered) P(weak wrong and strong right) is never observed; it is estimated per prompt as
    P(strong right)(1 - P(weak right)) from the two outputs, and p_strong is calibrated to that.
    With `cfg.calibration_folds` >= 2 the blend is fitted on cross-fitted scores, which costs that
    many extra trainings.
    """
    cfg = cfg or TrainConfig()
    if enc.recipe is None:  # the head must record what it reads, or it cannot be loaded with it
        raise ValueError("the prompts were not encoded by an embedder (routing.difficulty.encode)")
    check_trainable(data)
    known = data.known()
    head = _fit_parts(data, enc, cfg)
    if cfg.calibration_folds >= 2:
        components, correct, posterior = cross_fitted_components(data, enc, cfg, cfg.calibration_folds)
        if cfg.group_ridge > 0 and data.groups is not None:
            gain = data.strong.astype(np.float64) - data.weak
            head.group_gain = ridge_group_gain(posterior, gain, cfg.group_ridge)
            components[:, 0] = posterior @ head.group_gain
    else:
        components, correct = head.components(enc), head.correct(enc)
    target = calibration_target(data, correct)
    inputs, aucs = cfg.blend_inputs, None
    if inputs == "auto":
        inputs = "components"
        if cfg.calibration_folds >= 2:
            aucs = blend_aucs(components, enc.length, data)
            # Ties (and NaN, with no positive row) keep the simpler choice, in BLEND_INPUTS' order.
            inputs = max(BLEND_INPUTS, key=lambda k: -1.0 if np.isnan(aucs[k]) else aucs[k])
    elif inputs not in BLEND_INPUTS:
        raise ValueError(f"blend_inputs must be auto or one of {', '.join(BLEND_INPUTS)}, got {inputs!r}")
    components = blend_columns(components, enc.length, inputs)
    head.blend = fit_blend(components, target)
    # The blend's slope at its floor: the cross-fitted scores showed no skill (see fit_blend).
    slope = float(np.median(head.blend[:-1] * np.maximum(components.std(axis=0), 1e-6)))
    no_skill = slope <= MIN_BLEND_SLOPE * (1 + 1e-4)
    if (
        stems is not None
        and cfg.fallback_folds >= 2
        and data.groups is not None
        and len(set(data.groups)) >= 2
        and not data.partial
    ):
        head.fallback = fit_fallback(data, enc, stems, cfg)
    weak_rows, strong_rows = known[:, 0], known[:, 1]
    head.meta = {
        # A head that does not read length is one Weir versions before it read as well.
        "version": HEAD_VERSION if head.reads_length else LENGTH_VERSION - 1,
        "embedder": enc.recipe,
        "rows": len(data),
        "groups": sorted(set(data.groups)) if data.groups is not None else [],
        "weak_accuracy": float(data.weak[weak_rows].mean()),
        "strong_accuracy": float(data.strong[strong_rows].mean()),
        "needs_strong_share": float(target.mean()),
        "config": cfg.__dict__,
        "blend_inputs": inputs,
    }
    if aucs is not None:
        head.meta["blend_aucs"] = aucs
    if no_skill:
        head.meta["no_held_out_skill"] = True
    if data.partial:
        head.meta["weak_labelled"], head.meta["strong_labelled"] = (
            int(weak_rows.sum()),
            int(strong_rows.sum()),
        )
    return head


@dataclass(frozen=True)
class HoldoutResult:
    """How a freshly fitted head and a baseline head rank held-out prompts for one outcome."""

    outcome: str  # what a high p_strong should mean: "weak model wrong", or "needs the strong model"
    positives: int
    negatives: int
    trained: float  # AUC of the head fitted without these rows
    baseline: float  # AUC of the baseline head (the shipped one)
    difference: tuple[float, float]  # 95% bootstrap interval of trained - baseline, paired by row
    # Where the rows carry the score the route's head gave them when they were routed: how many do,
    # that head's AUC on them and this head's on the same rows (None: no such rows of both kinds).
    routed: tuple[int, float, float] | None = None

    def summary(self, baseline: str) -> str:
        lo, hi = self.difference
        text = (
            f"{self.outcome} ({self.positives} yes, {self.negatives} no): AUC {self.trained:.3f} this head, "
            f"{self.baseline:.3f} {baseline}; difference {self.trained - self.baseline:+.3f} [{lo:+.3f}, {hi:+.3f}]"
        )
        if self.routed is not None:
            rows, theirs, ours = self.routed
            text += (
                f"; on the {rows} routed with a stored score: {ours:.3f} this head, {theirs:.3f} as routed"
            )
        return text


def decisive(results: list[HoldoutResult]) -> HoldoutResult | None:
    """The held-out result a head is promoted on: the prompts that need the strong model, where rows
    know both outcomes (exactly what a difficulty route should send strong), else the weak model's
    failures; None when the held-out rows rank neither."""
    by_outcome = {r.outcome: r for r in results}
    return by_outcome.get("needs the strong model") or by_outcome.get("weak model wrong")


def should_promote(result: HoldoutResult, rule: str) -> bool:
    """Whether a head that ranked held-out prompts as `result` says should replace the baseline:
    "significant" when the 95% interval of its paired AUC gain lies above zero, "better" when the
    gain itself does."""
    if rule == "significant":
        return result.difference[0] > 0
    if rule == "better":
        return result.trained > result.baseline
    raise ValueError(f"unknown promotion rule {rule!r}")


def _fold_rank(scores: np.ndarray) -> np.ndarray:
    """Each score's mid-rank among `scores`, scaled to 0..1 (ties share their mean rank)."""
    return (mid_ranks(scores) - 1) / max(len(scores) - 1, 1)


def holdout_check(
    data: Outcomes,
    enc: Encoded,
    baseline: DifficultyHead,
    cfg: TrainConfig | None = None,
    share: float = 0.2,
    resamples: int = 1000,
    routed: np.ndarray | None = None,
    baseline_enc: Encoded | None = None,
    unseen: np.ndarray | None = None,
    cross_fit: bool = False,
    replay: np.ndarray | None = None,
) -> tuple[int, list[HoldoutResult]]:
    """Before a head fitted on your outcomes replaces the shipped one: fit one on all but a held-out
    `share` of the prompts (by prompt hash, so a repeated prompt never sits on both sides) and compare
    how it and `baseline` rank the held-out rows. Returns the held-out row count and one result per
    outcome the rows label: the weak model's failures (every row with the weak model's outcome) and,
    where both outcomes are known, the rows that need the strong model. Outcomes with no positive or
    no negative row are left out. `routed` (per row, NaN where unknown) is the score the route's head
    gave each request when it was routed: on the held-out rows that have one, the results also say
    how that head ranked them (`HoldoutResult.routed`), i.e. the head this one would replace.
    `baseline_enc`: the rows encoded for `baseline`, where it reads another embedder than `enc`'s.
    `unseen` (per row): the rows `baseline` was not trained on; only those held-out rows are ranked,
    since a head ranks the rows it was fitted on better than it will rank new traffic.
    `cross_fit`: hold out every fold in turn, each scored by a head fitted on the others, so every row
    is ranked (1/share fits instead of one): about sqrt(1/share) times narrower intervals. Fold heads
    fitted on a few hundred rows are calibrated differently, and ranking their raw scores together
    understated them badly (benchmarks/routing_loop.py), so both heads' scores are replaced by their
    rank within the fold first: what is compared is how each orders the rows of each fold.
    `replay` (per row): the rows `baseline` was fitted on, by this recipe (`cfg`). Each fold's rows are
    then scored by `baseline` refitted on the other folds' share of them, so every held-out row is
    ranked by two heads that did not see it, the one fitted on every other row and the one fitted on
    what `baseline` had: whether the rows since make a better head, with all rows as evidence instead
    of only the new ones (`unseen` is then not needed)."""
    folds = max(2, round(1 / share))
    fold_of = np.array([prompt_fold(p, folds) for p in data.prompts])
    held_folds = [k for k in (range(folds) if cross_fit else [0]) if (fold_of == k).any()]
    test_rows = np.flatnonzero(np.isin(fold_of, held_folds))
    out_of_fold, replayed = np.full(len(data), np.nan), np.full(len(data), np.nan)
    for k in held_folds:
        train_rows, rows_k = np.flatnonzero(fold_of != k), np.flatnonzero(fold_of == k)
        head = fit_head(data.subset(train_rows), enc.subset(train_rows), cfg)
        out_of_fold[rows_k] = head.p_strong(enc.subset(rows_k))
        if replay is not None:
            had = train_rows[replay[train_rows]]
            # It had every row this fold trains on: its refit is the fit just made (fitting is
            # deterministic), e.g. a nightly run with nothing new.
            replayed[rows_k] = (
                out_of_fold[rows_k]
                if len(had) == len(train_rows)
                else fit_head(data.subset(had), enc.subset(had), cfg).p_strong(enc.subset(rows_k))
            )
    held = data.subset(test_rows)
    ours = out_of_fold[test_rows]
    if replay is not None:
        theirs, unseen = replayed[test_rows], None
    else:
        theirs = baseline.p_strong((enc if baseline_enc is None else baseline_enc).subset(test_rows))
    if cross_fit:
        for k in held_folds:
            in_fold = fold_of[test_rows] == k
            ours[in_fold], theirs[in_fold] = _fold_rank(ours[in_fold]), _fold_rank(theirs[in_fold])
    known = held.known()
    outcomes: list[tuple[str, np.ndarray, np.ndarray]] = [("weak model wrong", known[:, 0], ~held.weak)]
    both = known[:, 0] & known[:, 1]
    if both.any():
        outcomes.append(("needs the strong model", both, np.logical_and(~held.weak, held.strong)))
    results = []
    for name, rows, label in outcomes:
        if unseen is not None:
            rows = rows & unseen[test_rows]
        y = label[rows]
        if y.all() or not y.any():
            continue
        found = auc_interval({"shipped": theirs[rows], "trained": ours[rows]}, y, rounds=resamples)
        as_routed = None
        if routed is not None:
            as_scored = routed[test_rows][rows]
            scored = np.isfinite(as_scored)
            if y[scored].any() and not y[scored].all():
                as_routed = (
                    int(scored.sum()),
                    auc(as_scored[scored], y[scored]),
                    auc(ours[rows][scored], y[scored]),
                )
        results.append(
            HoldoutResult(
                name,
                int(y.sum()),
                int((~y).sum()),
                found["trained"][0],
                found["shipped"][0],
                found["trained - shipped"][1:],
                as_routed,
            )
        )
    return len(test_rows), results
