"""Prompt difficulty: the probability that a request needs the strong model.

`DifficultyClassifier.default()` loads a head shipped in `routing/data/` with the embedder it was
trained on and scores a prompt in a few milliseconds of CPU:

    clf = DifficultyClassifier.default()
    clf.score("Prove that there are infinitely many primes.")   # -> p_strong in [0, 1]

Two heads ship. The encoder head (`routing/data/`) reads a 3-layer student distilled from MiniLM's
first three layers and is the better router on MMLU (cross-fitted APGR 0.701); the static head (v3,
`routing/data/static/`) reads a per-token table distilled from MiniLM (0.692) at a fraction of the
cost. The encoder's cost depends on the CPU far more than the table's: p99 3.8-4.6 ms a prompt in most
runs on a 2-core Zen 4 with AVX-512 VNNI for its int8 matmuls (v4, which read MiniLM's layers
themselves, cost twice that, and 19-26 ms on an AVX2-only Zen 3). `default("auto")` times the encoder on this machine and keeps it only if it fits the
request-path budget (`LATENCY_BUDGET_S`), else it serves the static head.

`p_strong` is the head's calibrated estimate that the weak model answers this prompt wrongly while the
strong model answers it correctly (on MMLU, 17% of prompts). A route sends the request to the strong
model when `p_strong` exceeds its threshold: set one directly, or let `StrongShareCalibrator` pick the
threshold that sends a target share of recent traffic to the strong model.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import re
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import structlog

if TYPE_CHECKING:
    from routing.embed import WordPieceEmbedder

# 2 added the sparse n-gram component, 3 the fallback for prompts without answer options, 4 reads the
# embedder its metadata names (MiniLM's first layers by default; 1-3 read the static table), 5 may blend
# the length feature in beside the components (a blend one weight longer; heads that do not are still
# written as 4). Older heads still load (1 and 2 score every prompt with the blend).
HEAD_VERSION = 5
READABLE_VERSIONS = (1, 2, 3, 4, 5)
LENGTH_VERSION = 5  # the first version whose blend may weigh the length feature
DEFAULT_HEAD_DIR = Path(__file__).parent / "data"  # the encoder head (v4)
# The static-table head (v3), byte for byte as shipped before v4.
STATIC_HEAD_DIR = DEFAULT_HEAD_DIR / "static"
HEAD_WEIGHTS = "difficulty_head.safetensors"
HEAD_META = "difficulty_head.json"
# In HEAD_META as `save` writes it (not in a head's `meta`): the sha256 of the HEAD_WEIGHTS it goes with.
WEIGHTS_DIGEST = "weights_sha256"


def length_feature(prompt: str) -> float:
    """log(characters), scaled to about [0, 1] for prompts up to ~3,000 characters."""
    return math.log1p(len(prompt)) / 8.0


# An answer option line: "A. ...", "B) ...", "(C) ...".
_OPTION = re.compile(r"^\(?([A-J])[.)]\s", re.MULTILINE)


def has_answer_options(prompt: str) -> bool:
    """Whether the prompt is a multiple-choice question: at least three lettered option lines (A-J).

    The shipped head learned from MMLU, where every prompt is one; on anything else (chat, code,
    maths asked plainly) its blend is out of its training distribution and the head scores the prompt
    with its fallback instead (`DifficultyHead.fallback`)."""
    letters: set[str] = set()
    for match in _OPTION.finditer(prompt):  # stops at the third letter: a long prompt can hold thousands
        letters.add(match.group(1))
        if len(letters) == 3:
            return True
    return False


def ngram_features(ids: list[int], buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """Sparse features of one prompt: its WordPiece unigrams (the id itself) and bigrams (hashed into
    the buckets above the vocabulary), as (indices, weights) with sublinear counts (1 + log tf)."""
    from routing.embed import VOCAB_SIZE

    a = np.asarray(ids, dtype=np.int64)
    bigrams = (a[:-1] * 1000003 + a[1:]) % (buckets - VOCAB_SIZE) + VOCAB_SIZE
    index, counts = np.unique(np.concatenate([a, bigrams]), return_counts=True)
    return index, 1.0 + np.log(counts)


def fallback_features(components: np.ndarray, length: np.ndarray, confidence: np.ndarray) -> np.ndarray:
    """What the fallback reads: the components, the length feature, the components times the group
    posterior's largest entry, and that entry: (n, 2 * components + 2)."""
    return np.concatenate(
        [components, length[:, None], components * confidence[:, None], confidence[:, None]], axis=1
    )


def with_length(components: np.ndarray, length: np.ndarray) -> np.ndarray:
    """The blend's inputs when it weighs the length feature: the components, then the length."""
    return np.concatenate([components, length[:, None].astype(components.dtype)], axis=1)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x**3)))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


@dataclass
class Encoded:
    """What the head reads about a batch of prompts."""

    token_ids: list[list[int]]  # MiniLM WordPiece ids, without [CLS]/[SEP]
    static: np.ndarray  # (n, 384) the embedder's sentence embeddings (static ones before head v4)
    length: np.ndarray  # (n,) length_feature of each prompt
    # (n,) has_answer_options of each prompt; None: all of them are (what the blend was fitted on)
    options: np.ndarray | None = None
    recipe: str | None = None  # the embedder's (routing.embed), which a head trained on this records

    def __len__(self) -> int:
        return len(self.token_ids)

    def subset(self, idx: np.ndarray) -> Encoded:
        options = None if self.options is None else self.options[idx]
        ids = [self.token_ids[i] for i in idx]
        return Encoded(ids, self.static[idx], self.length[idx], options, self.recipe)


def encode(embedder: WordPieceEmbedder, prompts: list[str]) -> Encoded:
    """Tokenise once and derive every input of the head."""
    ids = embedder.token_ids_many(prompts)
    length = np.array([length_feature(p) for p in prompts], dtype=np.float32)
    options = np.array([has_answer_options(p) for p in prompts], dtype=bool)
    return Encoded(ids, embedder.pool_many(ids), length, options, embedder.recipe)


@dataclass
class DifficultyHead:
    """The learned part, as plain numpy arrays.

    Inputs: a learned bag of the prompt's tokens (mean of `bag` rows: which words, fastText style, which
    is what tells MMLU subjects apart), the length feature and the static MiniLM embedding (what the
    prompt means). One hidden layer, then the weak-correct and strong-correct logits and the group logits.
    """

    bag: np.ndarray  # (vocab, bag_dim)
    w1: np.ndarray  # (hidden, bag_dim + 1 + 384)
    b1: np.ndarray  # (hidden,)
    w2: np.ndarray  # (2 + groups, hidden): weak-correct logit, strong-correct logit, group logits
    b2: np.ndarray
    # (groups,): each group's strong-minus-weak accuracy in the training data (shrunk towards the
    # overall mean), or with `TrainConfig.group_ridge` a ridge map from the posterior to the gain.
    group_gain: np.ndarray
    # Weights of the components (expected group gain, network strong-minus-weak, and with the sparse
    # part its strong-minus-weak), then, from version 5 where training chose it, of the length feature
    # (`reads_length`), then the bias: (3,) or (4,), (4,) or (5,) with length.
    blend: np.ndarray
    # The sparse n-gram part (version 2): TF-IDF over WordPiece uni- and bigrams, two logistic
    # regressions (weak right, strong right). Empty arrays in a version 1 head.
    idf: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # (buckets,)
    sparse_w: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.float32))  # (buckets, 2)
    sparse_b: np.ndarray = field(default_factory=lambda: np.zeros(2, np.float32))
    # Version 3: p_strong of prompts without answer options, a logistic regression over
    # `fallback_features` (components, length, components x group confidence, confidence), then the
    # bias: (9,). Fitted on MMLU question stems (options removed) scored by heads that never saw them,
    # half by heads that never saw their subject either (`routing.train.fit_fallback`): what carries to
    # questions asked plainly, and how far to trust the subject terms by how sure the subject guess is.
    # Empty: the blend scores every prompt.
    fallback: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    meta: dict[str, Any] = field(default_factory=dict)

    TENSORS = ("bag", "w1", "b1", "w2", "b2", "group_gain", "blend")
    SPARSE = ("idf", "sparse_w", "sparse_b")
    FALLBACK = ("fallback",)

    @property
    def component_count(self) -> int:
        return 2 + bool(len(self.idf))

    @property
    def reads_length(self) -> bool:
        """Whether the blend weighs the length feature beside the components (`TrainConfig.blend_inputs`)."""
        return len(self.blend) == self.component_count + 2

    @property
    def static_dim(self) -> int:
        return self.w1.shape[1] - self.bag.shape[1] - 1

    @property
    def embedder(self) -> str:
        """The recipe of the embedder this head was trained on (early heads, which name none, read the
        static table)."""
        from routing.embed import STATIC_RECIPE

        return str(self.meta.get("embedder", STATIC_RECIPE))

    def inputs(self, enc: Encoded) -> np.ndarray:
        bags = np.stack([self.bag[ids].mean(axis=0) for ids in enc.token_ids])
        return np.concatenate([bags, enc.length[:, None], enc.static], axis=1, dtype=np.float32)

    def _logits(self, enc: Encoded) -> np.ndarray:
        h = _gelu_tanh(self.inputs(enc) @ self.w1.T + self.b1)
        return h @ self.w2.T + self.b2

    def correct(self, enc: Encoded) -> np.ndarray:
        """(n, 2): the network's P(weak model right), P(strong model right)."""
        return _sigmoid(self._logits(enc)[:, :2])

    def sparse_correct(self, enc: Encoded) -> np.ndarray:
        """(n, 2): the sparse part's P(weak model right), P(strong model right)."""
        logits = np.empty((len(enc), 2), dtype=np.float32)
        for row, ids in enumerate(enc.token_ids):
            index, tf = ngram_features(ids, len(self.idf))
            x = tf * self.idf[index]
            x /= max(float(np.linalg.norm(x)), 1e-9)
            logits[row] = x @ self.sparse_w[index] + self.sparse_b
        return _sigmoid(logits)

    @staticmethod
    def _softmax_groups(logits: np.ndarray) -> np.ndarray:
        g = logits[:, 2:]
        g = np.exp(g - g.max(axis=1, keepdims=True))
        return g / g.sum(axis=1, keepdims=True)

    def group_posterior(self, enc: Encoded) -> np.ndarray:
        """(n, groups): the network's posterior over the training groups (e.g. MMLU subjects)."""
        return self._softmax_groups(self._logits(enc))

    def components(self, enc: Encoded) -> np.ndarray:
        """(n, 2 or 3) scores before blending: expected group gain (group posterior · `group_gain`),
        P(strong right) - P(weak right) from the network, and from the sparse part when the head has one."""
        return self.components_and_confidence(enc)[0]

    def components_and_confidence(self, enc: Encoded) -> tuple[np.ndarray, np.ndarray]:
        """`components`, and the group posterior's largest entry (how sure the head is which training
        group the prompt belongs to; 0 without groups)."""
        logits = self._logits(enc)
        p = _sigmoid(logits[:, :2])
        if len(self.group_gain):
            posterior = self._softmax_groups(logits)
            expected_gain, confidence = posterior @ self.group_gain, posterior.max(axis=1)
        else:
            expected_gain = confidence = np.zeros(len(enc), dtype=np.float32)
        parts = [expected_gain, p[:, 1] - p[:, 0]]
        if len(self.idf):
            q = self.sparse_correct(enc)
            parts.append(q[:, 1] - q[:, 0])
        return np.stack(parts, axis=1), confidence

    def p_strong(self, enc: Encoded) -> np.ndarray:
        components, confidence = self.components_and_confidence(enc)
        blended = with_length(components, enc.length) if self.reads_length else components
        logit = blended @ self.blend[:-1] + self.blend[-1]
        if len(self.fallback) and enc.options is not None and not enc.options.all():
            plain = ~enc.options
            x = fallback_features(components[plain], enc.length[plain], confidence[plain])
            logit[plain] = x @ self.fallback[:-1] + self.fallback[-1]
        return _sigmoid(logit)

    def tensors(self) -> dict[str, np.ndarray]:
        """The arrays as stored: float32, the big ones in half precision."""
        names = (
            self.TENSORS
            + (self.SPARSE if len(self.idf) else ())
            + (self.FALLBACK if len(self.fallback) else ())
        )
        tensors = {k: np.ascontiguousarray(getattr(self, k), dtype=np.float32) for k in names}
        # The token bag and the sparse weights are most of the bytes; half precision loses nothing
        # that matters for a mean or a sum of a few hundred terms.
        for big in ("bag", "idf", "sparse_w"):
            if big in tensors:
                tensors[big] = tensors[big].astype(np.float16)
        return tensors

    @classmethod
    def from_tensors(cls, tensors: dict[str, np.ndarray], meta: dict[str, Any], where: str) -> DifficultyHead:
        """A head from stored arrays; ValueError naming `where` when they cannot be one."""
        if meta.get("version") not in READABLE_VERSIONS:
            raise ValueError(
                f"difficulty head in {where} has version {meta.get('version')}, "
                f"this Weir reads versions {', '.join(map(str, READABLE_VERSIONS))}"
            )
        names = (
            cls.TENSORS
            + (cls.SPARSE if "idf" in tensors else ())
            + (cls.FALLBACK if "fallback" in tensors else ())
        )
        missing = [k for k in names if k not in tensors]
        if missing:
            raise ValueError(f"difficulty head in {where} lacks tensors {', '.join(missing)}")
        head = cls(**{k: np.asarray(tensors[k], dtype=np.float32) for k in names}, meta=meta)
        head.check(where)
        return head

    def check(self, where: str) -> None:
        """Raise ValueError unless the arrays fit together and the embedder is one this Weir has (a
        head that loaded and then failed on its first prompt would fail in the request path)."""
        from routing.embed import EMBEDDING_DIM, VOCAB_SIZE, check_recipe

        check_recipe(self.embedder)
        hidden = self.w1.shape[0] if self.w1.ndim == 2 else -1
        outputs = 2 + len(self.group_gain)
        components = self.component_count
        fallback = 2 * components + 3  # fallback_features, then the bias
        blend = ((components + 1,), (components + 2,))  # without and with the length feature
        expected = {
            "bag": (self.bag.ndim == 2 and self.bag.shape[0] >= VOCAB_SIZE, f"({VOCAB_SIZE}, bag_dim)"),
            "w1": (
                self.w1.ndim == 2 and self.w1.shape[1] == self.bag.shape[-1] + 1 + EMBEDDING_DIM,
                f"(hidden, bag_dim + 1 + {EMBEDDING_DIM})",
            ),
            "b1": (self.b1.shape == (hidden,), f"({hidden},)"),
            "w2": (self.w2.shape == (outputs, hidden), f"({outputs}, {hidden})"),
            "b2": (self.b2.shape == (outputs,), f"({outputs},)"),
            "group_gain": (self.group_gain.ndim == 1, "(groups,)"),
            "blend": (self.blend.shape in blend, f"({components + 1},) or ({components + 2},)"),
            "sparse_w": (self.sparse_w.shape == (len(self.idf), 2), f"({len(self.idf)}, 2)"),
            "sparse_b": (self.sparse_b.shape == (2,), "(2,)"),
            "fallback": (self.fallback.shape in ((0,), (fallback,)), f"(0,) or ({fallback},)"),
        }
        if self.reads_length and int(self.meta.get("version", HEAD_VERSION)) < LENGTH_VERSION:
            expected["blend"] = (False, f"({components + 1},) before version {LENGTH_VERSION}")
        for name, (ok, shape) in expected.items():
            if not ok:
                raise ValueError(
                    f"difficulty head in {where}: {name} has shape {getattr(self, name).shape}, expected {shape}"
                )
        for name in self.TENSORS + self.SPARSE + self.FALLBACK:
            if not np.isfinite(getattr(self, name)).all():
                raise ValueError(f"difficulty head in {where}: {name} holds NaN or infinite values")

    def save(self, directory: Path) -> None:
        """Write the head into `directory`, replacing any head there, never leaving one that `load`
        would take for whole when it is not. Each file is written beside its target under a temporary
        name, flushed to disk, and renamed over it (a rename replaces a file at once): the weights,
        then the metadata, which names the weights it goes with by their digest. A save that fails
        while writing its files (disk full, killed) leaves the previous head as it was; one cut short
        between the two renames, or two saves to one directory interleaved, leaves weights under
        metadata that does not name them, which `load` refuses instead of serving a head no run
        trained. (Written in place, a failure between the two files left such a head, and it loaded.)"""
        from safetensors.numpy import save

        directory.mkdir(parents=True, exist_ok=True)
        weights = save(self.tensors())
        meta = {**self.meta, WEIGHTS_DIGEST: hashlib.sha256(weights).hexdigest()}
        suffix = f".{os.getpid()}-{os.urandom(4).hex()}.tmp"
        staged = {name: directory / f".{name}{suffix}" for name in (HEAD_WEIGHTS, HEAD_META)}
        try:
            staged[HEAD_WEIGHTS].write_bytes(weights)
            staged[HEAD_META].write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
            for name in (HEAD_WEIGHTS, HEAD_META):  # the metadata last: it vouches for the weights
                _flush_to_disk(staged[name])
                os.replace(staged[name], directory / name)
        finally:
            for path in staged.values():
                path.unlink(missing_ok=True)

    @classmethod
    def load(cls, directory: Path) -> DifficultyHead:
        """The head `save` wrote; ValueError naming the directory when its files are not one."""
        from safetensors import SafetensorError
        from safetensors.numpy import load

        try:
            meta = json.loads((directory / HEAD_META).read_text())
        except ValueError as exc:
            raise ValueError(f"{directory / HEAD_META}: {exc}") from None
        if not isinstance(meta, dict):
            raise ValueError(f"{directory / HEAD_META} must hold a JSON object")
        data = (directory / HEAD_WEIGHTS).read_bytes()
        try:
            tensors = load(data)
        except SafetensorError as exc:  # not a ValueError: a broken file read as a traceback
            raise ValueError(f"{directory / HEAD_WEIGHTS}: {exc}") from None
        # Absent from heads saved before it was written (the shipped ones among them).
        expected = meta.pop(WEIGHTS_DIGEST, None)
        if expected is not None and expected != hashlib.sha256(data).hexdigest():
            raise ValueError(
                f"{directory}: {HEAD_WEIGHTS} is not the weights {HEAD_META} was saved with (a save cut "
                "short between the two files, or one of them replaced): save or train the head again"
            )
        return cls.from_tensors(tensors, meta, str(directory))


def _flush_to_disk(path: Path) -> None:
    # Before the rename that puts it in place: after a power cut the new name must not point at a
    # file whose data never reached the disk.
    with path.open("rb") as file:
        os.fsync(file.fileno())


class DifficultyClassifier:
    """Scores prompts: p_strong in [0, 1]. Thread-safe; the embedder and head are read-only."""

    def __init__(self, head: DifficultyHead, embedder: WordPieceEmbedder) -> None:
        if head.embedder != embedder.recipe:
            raise ValueError(f"head was trained on embedder {head.embedder!r}, this is {embedder.recipe!r}")
        if head.static_dim != embedder.dim:
            raise ValueError(f"head expects {head.static_dim}-dim embeddings, embedder gives {embedder.dim}")
        self.head = head
        self.embedder = embedder

    @classmethod
    def load(cls, head_dir: Path = DEFAULT_HEAD_DIR) -> DifficultyClassifier:
        """A head and the embedder it was trained on."""
        from routing.embed import shared_embedder

        head = DifficultyHead.load(head_dir)
        return cls(head, shared_embedder(head.embedder))

    @classmethod
    def default(cls, head: HeadChoice = "auto") -> DifficultyClassifier:
        """A shipped classifier, loaded once per process: "encoder" (v4), "static" (v3), or "auto"
        (the encoder where it fits the latency budget on this machine, else the static head)."""
        if head not in HEADS:
            raise ValueError(f"difficulty head must be one of {', '.join(HEADS)}, got {head!r}")
        # Locked: the router's warm-up and a first request may ask at once, and loading twice costs memory.
        with _default_lock:
            return _cached_default(head)

    @property
    def kind(self) -> str:
        """ "encoder" or "static": which embedder family the head reads."""
        from routing.embed import STATIC_RECIPE

        return "static" if self.embedder.recipe == STATIC_RECIPE else "encoder"

    def score(self, prompt: str) -> float:
        # One prompt: the tokenizer's plain encode, not its thread-pooled batch path.
        ids = self.embedder.token_ids(prompt)
        enc = Encoded(
            [ids],
            self.embedder.pool(ids)[None, :],
            np.array([length_feature(prompt)], np.float32),
            np.array([has_answer_options(prompt)]),
            self.embedder.recipe,
        )
        return float(self.head.p_strong(enc)[0])

    def score_many(self, prompts: list[str]) -> list[float]:
        if not prompts:
            return []
        return self.head.p_strong(encode(self.embedder, prompts)).astype(float).tolist()


HeadChoice = Literal["auto", "encoder", "static"]
HEADS: tuple[HeadChoice, ...] = ("auto", "encoder", "static")
# The request-path budget for scoring one prompt (p99), from issue #5.
LATENCY_BUDGET_S = 0.005
# p99 over median of one prompt's scoring time, scored again and again on an otherwise idle 2-core VM
# (1.46-1.49 on the Zen 3 of docs/benchmarks.md's eighth round): "auto" keeps the encoder when its
# median for `TIMING_PROMPT` times this fits the budget.
TAIL_FACTOR = 1.5
# What "auto" times: a multiple-choice prompt about as long as MMLU's 99th percentile (2,190 characters),
# so the median is the cost of a prompt at the tail (the encoder reads its first 96 tokens, the token
# bag and sparse part its first 510, the tokenizer at most a few thousand characters).
TIMING_PROMPT = (
    " ".join(
        f"In trial {i}, a 2.0 kg block slides {i + 2}.0 m down a frictionless incline of {20 + i} degrees "
        "and then compresses a spring of constant 400 N/m on a rough floor."
        for i in range(14)
    )
    + " Across the trials, what is the largest compression of the spring, and where is it reached?\n"
    "A. 0.62 m, in trial 3\nB. 0.66 m, in trial 7\nC. 0.70 m, in trial 13\nD. 0.74 m, in trial 0\nAnswer:"
)

_default_lock = threading.Lock()
log = structlog.get_logger("weir.routing")


def scoring_time(clf: DifficultyClassifier, runs: int = 21, prompt: str = TIMING_PROMPT) -> float:
    """Median seconds `clf.score` takes for `prompt` on this machine, with the process's torch threads."""
    for _ in range(3):
        clf.score(prompt)  # warm-up: first calls allocate and page in the weights
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        clf.score(prompt)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def pick_head(
    encoder: DifficultyClassifier,
    budget_s: float = LATENCY_BUDGET_S,
    timer: Callable[[DifficultyClassifier], float] = scoring_time,
) -> HeadChoice:
    """ "encoder" if its median time for a full-length prompt, times `TAIL_FACTOR`, fits `budget_s`,
    else "static". Startup contention can only inflate the timing, so a busy start errs toward the
    cheaper head, never toward a slow one."""
    seconds = float(timer(encoder))
    choice: HeadChoice = "encoder" if seconds * TAIL_FACTOR <= budget_s else "static"
    log.info(
        "difficulty_head_chosen",
        head=choice,
        encoder_median_ms=round(seconds * 1e3, 2),
        estimated_p99_ms=round(seconds * TAIL_FACTOR * 1e3, 2),
        budget_ms=budget_s * 1e3,
    )
    return choice


@cache
def _cached_default(head: HeadChoice) -> DifficultyClassifier:
    if head == "static":
        return DifficultyClassifier.load(STATIC_HEAD_DIR)
    if head == "encoder":
        return DifficultyClassifier.load(DEFAULT_HEAD_DIR)
    # auto: the encoder is timed here and kept in the cache only if chosen.
    encoder = DifficultyClassifier.load(DEFAULT_HEAD_DIR)
    if pick_head(encoder) == "encoder":
        return encoder
    del encoder
    return _cached_default("static")


def prompt_text(messages: list[dict[str, Any]]) -> str:
    """The text a difficulty score should read from an OpenAI-shaped chat: the last user turn.

    Earlier turns and the system prompt mostly say who the assistant is, not how hard this question
    is; content parts other than text (images, audio) are ignored.
    """
    for message in reversed(messages):
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            return "\n".join(
                p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
            )
    return ""


@dataclass(frozen=True, slots=True)
class StrongCall:
    """A calibrator's answer for one request (`StrongShareCalibrator.call`), kept apart from counting
    the request as traffic (`count`), which waits until it is sent."""

    score: float
    strong: bool
    threshold: float  # as it is with this request counted


class StrongShareCalibrator:
    """Turns "send about X% of traffic to the strong model" into a score threshold.

    Keeps the last `window` scores; a request goes strong when its score is in the top `target_share`
    of them, its own counted: the threshold is the highest score not wholly in that top share, and
    scores strictly above it go strong. The top share of n scores is `target_share * n`, rarely a whole
    number of them: the score at its edge, and every score tied with it (a window of repeated prompts,
    a head that scores many alike), goes strong in the proportion that keeps the target, spread evenly
    over such requests by a running credit. So the share holds from the first request (a score's rank
    among the few seen is as likely to be any), in a window of any size, for any target, and in a
    burst decided before any of it is counted. With `initial_threshold`, that threshold applies
    instead until `min_samples` scores have been seen (a prior you trust, e.g. the same quantile on
    the training data). A NaN score ranks nowhere: it goes weak and is never counted. Deciding is
    O(window), observing O(log window), and both are thread-safe.
    """

    def __init__(
        self,
        target_share: float,
        window: int = 2000,
        min_samples: int = 50,
        initial_threshold: float | None = None,
    ) -> None:
        if not 0.0 <= target_share <= 1.0:
            raise ValueError(f"target_share must be within [0, 1], got {target_share}")
        if window < 1 or min_samples < 1:
            raise ValueError("window and min_samples must be positive")
        self.target_share = target_share
        self.window = window
        self.min_samples = min_samples
        self.initial_threshold = initial_threshold
        self._recent: deque[float] = deque()
        self._sorted: list[float] = []
        self._credit = 0.0  # strong calls owed to scores at the top share's edge, in [0, 1) (see `call`)
        self._lock = threading.Lock()

    def observe(self, score: float) -> None:
        with self._lock:
            self._observe(score)

    def _observe(self, score: float) -> None:
        if math.isnan(score):  # unordered: in the sorted index it broke every later look-up
            return
        self._recent.append(score)
        bisect.insort(self._sorted, score)
        if len(self._recent) > self.window:
            old = self._recent.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]

    def threshold(self) -> float:
        """Scores strictly above this go to the strong model (inf: none seen yet)."""
        with self._lock:
            return self._threshold(self._sorted)[0]

    def _threshold(self, scores: list[float]) -> tuple[float, float]:
        """The threshold over `scores` (sorted), and how many of them the target share is (a fraction
        of one at its edge; -1: not calibrated, `initial_threshold` applies)."""
        n = len(scores)
        if self.target_share >= 1.0:
            return -math.inf, float(n)
        if self.target_share <= 0.0:
            return math.inf, 0.0
        if self.initial_threshold is not None and n < self.min_samples:
            return self.initial_threshold, -1.0
        if n == 0:
            return math.inf, 0.0
        # Rounded to 9 places: 0.1 * 30 is 3.0000000000000004, which would owe a sliver to the 4th.
        strong = round(self.target_share * n, 9)
        # Rounded to a whole number (round(0.3 * 1) is 0, round(0.5 * 10) is 4, round(0.0005 * 100)
        # is 0), the share was off by up to half a score in every window: never strong in a window of
        # 1 below a share of 0.7 or for a share under 0.5% of the 2,000 scores, 20% for 25% of 10.
        whole = math.floor(strong)
        # A target a hair below 1 can round to every score: all go strong (scores[-1], the highest,
        # read as the threshold, sent only the top one).
        return (scores[n - whole - 1] if whole < n else -math.inf), strong

    def call(self, score: float, preview: bool = False) -> StrongCall:
        """Whether a request of `score` goes to the strong model, judged on the window with its score
        in it; the window is left as it is (`count` adds it once the request is sent: one the gateway
        refused, or a token count, is no traffic). A `preview` leaves the credit as it is too."""
        with self._lock:
            if math.isnan(score):
                return StrongCall(score, False, self._threshold(self._sorted)[0])
            scores = self._sorted.copy()
            bisect.insort(scores, score)
            if len(self._recent) >= self.window:  # as `_observe` would drop the oldest
                del scores[bisect.bisect_left(scores, self._recent[0])]
            threshold, strong = self._threshold(scores)
            if score != threshold or strong < 0:
                return StrongCall(score, score > threshold, threshold)
            # At the edge of the top share: of the window's scores equal to this one, `strong - above`
            # are in the top share (a fraction of one, or several tied). Send that proportion of such
            # requests strong, deterministically by a running credit. Moved here rather than when the
            # request is counted: a burst decided before any of it was sent all read one credit, and
            # went all strong or all weak.
            equal = bisect.bisect_right(scores, score) - bisect.bisect_left(scores, score)
            above = len(scores) - bisect.bisect_right(scores, score)
            owed = min(max((strong - above) / equal, 0.0), 1.0)
            go = self._credit + owed >= 1.0
            if not preview:
                self._credit += owed - go
            return StrongCall(score, go, threshold)

    def count(self, call: StrongCall) -> None:
        """Count the request `call` answered for as traffic: its score joins the window."""
        with self._lock:
            self._observe(call.score)

    def route_strong(self, score: float) -> bool:
        """Whether a request of `score` goes to the strong model, counted as traffic at once."""
        call = self.call(score)
        self.count(call)
        return call.strong

    def retargeted(self, target_share: float) -> StrongShareCalibrator:
        """A calibrator for another target over this one's window (the same head's scores rank alike
        whatever share is asked of them), of the same size."""
        other = StrongShareCalibrator(target_share, self.window, self.min_samples, self.initial_threshold)
        with self._lock:
            other._recent.extend(self._recent)
            other._sorted = self._sorted.copy()
        return other

    def __len__(self) -> int:
        return len(self._recent)
