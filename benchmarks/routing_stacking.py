"""Attempts to lift the difficulty head past APGR 0.70 (issue #5), cross-fitted on routing_eval's hash folds.

    nice -n 10 .venv/bin/python benchmarks/routing_stacking.py --data ../shared/data/routing-mmlu

Every score comes from models that never saw the prompt: the heads' components are cross-fitted on the
5 prompt-hash folds of `routing_eval.py`, and anything fitted on top of them (blend spreads, a ridge map,
a gradient-boosted stacker) is fitted on the other folds' cross-fitted scores, as `blend_across_folds`
does. APGR with a 95% bootstrap interval, and a paired bootstrap interval of the difference to the v3
recipe (equal unit-spread blend of the shipped components) on the same prompts. What it tries:

1. a wider network (hidden 512 instead of 256; seeds 0-2), the sparse part unchanged;
2. the group term as a ridge map from the cross-fitted subject posterior to the gain (strong minus weak
   right), instead of the posterior times each subject's mean gain;
3. a HistGradientBoosting regression of the gain over [components, log length, structure features,
   posterior], mixed 1:1 with the blend; and the structure features' within-subject correlation;
4. the off-MMLU probe: adding length or token-rarity scores to the shipped head, MMLU APGR against
   probe AUC;
5. (`--artefact-only`) the label artefact: GPT-4 is right on 3% of high_school_mathematics (Mixtral
   32%, chance 25%), so a router earns APGR by sending that subject to the weak model. Heads trained
   with that subject's strong outcomes marked unknown (the partial-label path of live feedback),
   the ridge-mapped group term fitted without its rows: APGR on all prompts and without the subject,
   and the non-MMLU probe's AUC.
6. (`--ceiling-only`) how much room there is: what a router that knew each prompt's subject would
   score (subject means from the training folds, and from all rows, the scored ones included: an
   optimistic bound), how strongly each component and two new candidate signals (the answer options'
   static-embedding similarity to the question and to each other; a ridge regression of each prompt's
   gain minus its subject's mean on TF-IDF n-grams) track the gain *within* a subject, and the residual
   regression added to the v3 ranking.

7. (`--encoder-only`) the full MiniLM encoder instead of its static distillation: every prompt encoded
   once by the transformer (mean pooling, 256 tokens), the v3 head trained and scored on those
   embeddings in place of the static ones; a static table *learned* to reproduce them (per token
   vectors W0 A + D, fitted per outer fold on its training prompts only, cosine loss, L2 on D), the
   cheap stand-in; and what the encoder costs per prompt on one core at the data's token lengths.

8. (`--depth-only`) a shallower, shorter encoder: the embedding mean-pooled after each of MiniLM's
   first layers (`--depths`), with inputs cut short (`--max-tokens`), the matmuls in float32, bf16 or
   int8 (`--compute`), the v3 head trained and scored on each. The encoder's cost grows with layers
   times tokens, so this is what fits a latency budget; it chose head v4's embedder (3 layers, 96
   tokens, int8).

    nice -n 10 .venv/bin/python benchmarks/routing_stacking.py --data ../shared/data/routing-mmlu --artefact-only
    nice -n 10 .venv/bin/python benchmarks/routing_stacking.py --data ../shared/data/routing-mmlu --ceiling-only
    nice -n 10 .venv/bin/python benchmarks/routing_stacking.py --data ../shared/data/routing-mmlu --encoder-only
    nice -n 10 .venv/bin/python benchmarks/routing_stacking.py --data ../shared/data/routing-mmlu --depth-only
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.routing_eval import ARTEFACT_SUBJECT, PROBE, auc, metrics
from routing.difficulty import DifficultyClassifier, Encoded, encode, ngram_features
from routing.embed import StaticEmbedder
from routing.train import Outcomes, TrainConfig, _fit_parts, load_mmlu, prompt_fold, ridge_group_gain

_NUMBER = re.compile(r"^[\s$-]*[\d.,/%]+\s*[a-zA-Z%]{0,6}\s*$")
STRUCTURE = (
    "log stem chars",
    "log option chars",
    "option length CV",
    "option max/min length (log)",
    "numeric options share",
    "log digits in stem",
    "log digits in options",
    "log formula symbols",
    "NOT/EXCEPT/LEAST/FALSE",
    "lowercase negations",
    "'which of the following'",
    "all/none/both of the above",
    "roman-numeral options",
    "'Statement 1'",
    "'Scenario 1'",
    "log sentences",
    "stem ends with '?'",
    "log stem newlines",
    "mean words per option",
    "options",
    "blank '_'",
    "true/false options",
)


def split_options(prompt: str) -> tuple[str, list[str]]:
    """An MMLU prompt's question stem and its answer options (none for a prompt without `A. ` lines)."""
    head, sep, tail = prompt.rpartition("\nA. ")
    if not sep:
        return prompt.removesuffix("Answer:").rstrip(), []
    body = tail.removesuffix("Answer:").rstrip()
    return head, re.split(r"\n[B-J]\. ", body)


def structure_features(prompt: str) -> np.ndarray:
    """The question's form, in the order of `STRUCTURE`: lengths, numbers, formulas, negations, options."""
    stem, opts = split_options(prompt)
    lens = np.array([len(o) for o in opts], float) if opts else np.zeros(1)
    low = stem.lower()
    return np.array(
        [
            math.log1p(len(stem)),
            math.log1p(lens.sum()),
            lens.std() / max(lens.mean(), 1.0),
            math.log((lens.max() + 1) / (lens.min() + 1)),
            np.mean([bool(_NUMBER.match(o)) for o in opts]) if opts else 0.0,
            math.log1p(sum(c.isdigit() for c in stem)),
            math.log1p(sum(c.isdigit() for o in opts for c in o)),
            math.log1p(sum(stem.count(c) for c in "=^\\$+*/<>")),
            float(bool(re.search(r"\b(NOT|EXCEPT|LEAST|FALSE)\b", stem))),
            float(len(re.findall(r"\b(not|except|least|false|incorrect)\b", low))),
            float("which of the following" in low),
            float(any(re.search(r"(all|none|both) of the (above|these)", o.lower()) for o in opts)),
            float(any(re.fullmatch(r"\s*(I|II|III|IV)\b[IV ,andonly]*", o) for o in opts)),
            float("statement 1" in low),
            float("scenario 1" in low),
            math.log1p(len(re.findall(r"[.!?](\s|$)", stem))),
            float(stem.rstrip().endswith("?")),
            math.log1p(stem.count("\n")),
            np.mean([len(o.split()) for o in opts]) if opts else 0.0,
            float(len(opts)),
            float("_" in stem),
            float(any(o.strip().lower() in ("true", "false", "true, true") for o in opts)),
        ],
        dtype=np.float32,
    )


def cross_fitted(
    data: Outcomes,
    enc: Encoded,
    fold: np.ndarray,
    cfg: TrainConfig,
    static_by_fold: dict[int, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Components and the subject posterior of every prompt, from heads trained without its fold.

    `static_by_fold`: each fold's own embeddings of every prompt (an encoder distilled on that fold's
    training prompts), read by that fold's head in place of `enc.static`."""
    n = len(data)
    groups = sorted(set(data.groups or []))
    out = {
        "components": np.zeros((n, 3 if cfg.sparse_buckets else 2)),
        "posterior": np.zeros((n, len(groups))),
    }
    for k in np.unique(fold):
        train, test = np.nonzero(fold != k)[0], np.nonzero(fold == k)[0]
        fold_enc = enc if static_by_fold is None else dataclasses.replace(enc, static=static_by_fold[k])
        head = _fit_parts(data.subset(train), fold_enc.subset(train), cfg)
        held_out = fold_enc.subset(test)
        out["components"][test] = head.components(held_out)
        logits = head._logits(held_out)[:, 2:]
        g = np.exp(logits - logits.max(axis=1, keepdims=True))
        # A fold's head knows only its training rows' groups (fewer when whole subjects are held out).
        columns = [groups.index(name) for name in sorted({data.groups[i] for i in train})]
        out["posterior"][np.ix_(test, columns)] = g / g.sum(axis=1, keepdims=True)
    return out


def across_folds(fit, x: np.ndarray, y: np.ndarray, fold: np.ndarray) -> np.ndarray:
    """Each fold's prediction from `fit()` fitted on the other folds' rows (x: cross-fitted scores)."""
    out = np.zeros(len(x))
    for k in np.unique(fold):
        test = fold == k
        out[test] = fit().fit(x[~test], y[~test]).predict(x[test])
    return out


def equal_blend(components: np.ndarray, fold: np.ndarray) -> np.ndarray:
    """The v3 ranking: components scaled to unit spread on the other folds, summed."""
    out = np.zeros(len(components))
    for k in np.unique(fold):
        test = fold == k
        out[test] = components[test] @ (1.0 / components[~test].std(axis=0))
    return out


def ridge_blend(parts: dict[str, np.ndarray], gain: np.ndarray, fold: np.ndarray, fit_rows: np.ndarray):
    """The v3 blend with a ridge-mapped group term (alpha 1, fitted on the other folds' `fit_rows`):
    the cross-fitted score of every row, and per fold the (group gains, component scales) it used."""
    score, used = np.zeros(len(gain)), []
    for k in np.unique(fold):
        test = fold == k
        rows = ~test & fit_rows
        group_gain = ridge_group_gain(parts["posterior"][rows], gain[rows], 1.0)
        c = np.column_stack([parts["posterior"] @ group_gain, parts["components"][:, 1:]])
        scale = 1.0 / c[~test].std(axis=0)
        score[test] = c[test] @ scale
        used.append((group_gain, scale))
    return score, used


def artefact(data: Outcomes, enc: Encoded, fold: np.ndarray, report, embedder: StaticEmbedder) -> None:
    """Heads that do not learn the artefact subject's strong outcomes, against the same recipe that does."""
    gain = data.strong.astype(float) - data.weak
    clean = np.array([g != ARTEFACT_SUBJECT for g in data.groups])
    masked = Outcomes(data.prompts, data.weak, data.strong, data.groups, None, clean)
    probe = [p for _, p in PROBE["easy"]] + [p for _, p in PROBE["hard"]]
    kinds = np.array([k for k, _ in PROBE["easy"]] + [k for k, _ in PROBE["hard"]])
    hard = np.arange(len(probe)) >= len(PROBE["easy"])
    probe_enc = encode(embedder, probe)
    cfg = TrainConfig(calibration_folds=0)
    w, s = data.weak[clean].astype(float), data.strong[clean].astype(float)
    ref = None
    for name, rows, fit_rows in (
        ("as labelled", data, np.ones(len(data), bool)),
        ("strong unknown", masked, clean),
    ):
        t0 = time.perf_counter()
        parts = cross_fitted(rows, enc, fold, cfg)
        score, used = ridge_blend(parts, gain, fold, fit_rows)
        ref = score if ref is None else ref
        # The probe: one head on all rows, its group gains and component scales as the folds fit them.
        head = _fit_parts(rows, enc, cfg)
        head.group_gain = np.mean([g for g, _ in used], axis=0).astype(np.float32)
        p = head.components(probe_enc) @ np.mean([c for _, c in used], axis=0)
        by_kind = " ".join(
            f"{k} {auc(p[hard & (kinds == k)], p[~hard & (kinds == k)]):.2f}" for k in sorted(set(kinds))
        )
        report(f"ridge blend, {ARTEFACT_SUBJECT} {name}", score, None if score is ref else ref, "as labelled")
        print(
            f"    without {ARTEFACT_SUBJECT}: APGR {metrics(score[clean], w, s)['APGR']:.4f};"
            f" probe AUC {auc(p[hard], p[~hard]):.2f} ({by_kind}); {time.perf_counter() - t0:.0f} s,"
            f" load {os.getloadavg()[0]:.1f}",
            flush=True,
        )


def option_similarity(embedder: StaticEmbedder, prompt: str) -> np.ndarray:
    """Static-embedding cosines of an MMLU prompt's options: the closest option to the question, the
    closest minus the runner-up, and the mean and largest similarity between two options."""
    stem, opts = split_options(prompt)
    if len(opts) < 2:
        return np.zeros(4)
    e = embedder.embed_many([stem, *opts])
    to_question = np.sort(e[1:] @ e[0])[::-1]
    between = (e[1:] @ e[1:].T)[np.triu_indices(len(opts), 1)]
    return np.array([to_question[0], to_question[0] - to_question[1], between.mean(), between.max()])


def ceiling(data: Outcomes, enc: Encoded, fold: np.ndarray, report, embedder: StaticEmbedder) -> None:
    """Experiment 6: the room left above v3, and whether any signal inside a subject is being missed."""
    import scipy.sparse as sp
    from sklearn.feature_extraction.text import TfidfTransformer
    from sklearn.linear_model import Ridge

    gain = data.strong.astype(float) - data.weak.astype(float)
    groups = np.array(data.groups)
    subjects = np.unique(groups)

    def within(v: np.ndarray) -> np.ndarray:
        v = v.astype(float).copy()
        for g in subjects:
            v[groups == g] -= v[groups == g].mean()
        return v

    def zscore(v: np.ndarray) -> np.ndarray:
        return (v - v.mean()) / v.std()

    v3 = cross_fitted(data, enc, fold, TrainConfig(calibration_folds=0))
    ref = equal_blend(v3["components"], fold)
    report("v3 recipe (equal blend of group, network, sparse)", ref, None)
    prior = np.zeros(len(gain))
    for k in np.unique(fold):
        train, test = fold != k, fold == k
        means = {g: gain[train & (groups == g)].mean() for g in subjects}
        prior[test] = [means[g] for g in groups[test]]
    report("subject known: its mean gain on the training folds", prior, ref)
    report(
        "v3 with that in place of the group term (labels at scoring)",
        equal_blend(np.column_stack([prior, v3["components"][:, 1:]]), fold),
        ref,
    )
    # Looked up, not computed as gain - within(gain): rounding would differ between a subject's right and
    # wrong rows and break the score's ties by the label.
    means = {g: gain[groups == g].mean() for g in subjects}
    report(
        "subject known: its mean gain on all rows (scored ones included)",
        np.array([means[g] for g in groups]),
        ref,
    )

    y = within(gain)
    print("\ncorrelation with the gain within subjects (both centred per subject)")
    for j, name in enumerate(("group term", "network gain", "sparse gain")):
        print(f"  {name:<44} r = {np.corrcoef(within(v3['components'][:, j]), y)[0, 1]:+.4f}")
    print(f"  {'v3 blend':<44} r = {np.corrcoef(within(ref), y)[0, 1]:+.4f}")
    sims = np.stack([option_similarity(embedder, p) for p in data.prompts])
    for j, name in enumerate(
        (
            "closest option to the question",
            "closest minus runner-up",
            "mean option-option",
            "max option-option",
        )
    ):
        print(f"  {name:<44} r = {np.corrcoef(within(sims[:, j]), y)[0, 1]:+.4f}")

    rows, cols, vals = [], [], []
    for row, ids in enumerate(enc.token_ids):
        index, tf = ngram_features(ids, 1 << 18)
        rows.append(np.full(len(index), row))
        cols.append(index)
        vals.append(tf)
    x = sp.csr_matrix(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), (len(gain), 1 << 18)
    )
    for alpha in (3.0, 10.0, 30.0):
        residual = np.zeros(len(gain))
        for k in np.unique(fold):
            train, test = fold != k, fold == k
            tfidf = TfidfTransformer().fit(x[train])
            means = {g: gain[train & (groups == g)].mean() for g in subjects}
            target = gain[train] - np.array([means[g] for g in groups[train]])
            model = Ridge(alpha=alpha).fit(tfidf.transform(x[train]), target)
            residual[test] = model.predict(tfidf.transform(x[test]))
        r = np.corrcoef(within(residual), y)[0, 1]
        print(f"\nridge (alpha {alpha:g}) of gain minus subject mean on TF-IDF n-grams: within r = {r:+.4f}")
        for lam in (0.1, 0.25, 0.5):
            report(
                f"v3 + {lam} x the residual regression (z-scores)", zscore(ref) + lam * zscore(residual), ref
            )


def learned_table(x, targets, base, l2: float, steps: int = 300):  # x: torch sparse CSR (rows, vocab)
    """A static table whose pooled rows reproduce `targets` (cosine): base @ A + D, L2 on D only, so
    tokens the rows never show still move with the learned linear map A."""
    import torch

    d = torch.zeros_like(base, requires_grad=True)
    a = torch.eye(base.shape[1], requires_grad=True)
    opt = torch.optim.Adam([d, a], lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        pooled = x @ (base @ a + d)
        loss = (1 - torch.nn.functional.cosine_similarity(pooled, targets)).mean() + l2 * (d * d).sum()
        loss.backward()
        opt.step()
    return (base @ a + d).detach()


def encoder(data: Outcomes, enc: Encoded, fold: np.ndarray, report, embedder: StaticEmbedder) -> None:
    """Experiment 7: the full MiniLM encoder in place of the static table, and a learned static table."""
    import torch

    from routing.minilm import MiniLMEncoder

    torch.set_num_threads(os.cpu_count() or 1)
    model = MiniLMEncoder(max_tokens=256)
    t0 = time.perf_counter()
    contextual = model.encode(data.prompts, batch_size=32).numpy()
    print(f"{len(data)} prompts encoded by MiniLM in {time.perf_counter() - t0:.0f} s", flush=True)
    v3 = cross_fitted(data, enc, fold, TrainConfig(calibration_folds=0))
    ref = equal_blend(v3["components"], fold)
    report("v3 recipe (static MiniLM table)", ref, None)
    groups = sorted(set(data.groups or []))
    truth = np.array([groups.index(g) for g in data.groups or []])
    full = cross_fitted(
        data,
        Encoded(enc.token_ids, contextual, enc.length, enc.options),
        fold,
        TrainConfig(calibration_folds=0),
    )
    report("v3 recipe on full-encoder embeddings", equal_blend(full["components"], fold), ref)
    for j, name in enumerate(("group term", "network gain")):
        swapped = v3["components"].copy()
        swapped[:, j] = full["components"][:, j]
        report(f"v3 with only the {name} from the full encoder", equal_blend(swapped, fold), ref)
    print(
        f"  subject named right by the head's posterior: static {(v3['posterior'].argmax(1) == truth).mean():.3f}, "
        f"full encoder {(full['posterior'].argmax(1) == truth).mean():.3f}"
    )

    rows, cols, vals = [], [], []
    for row, ids in enumerate(enc.token_ids):
        index, counts = np.unique(ids, return_counts=True)
        rows.append(np.full(len(index), row))
        cols.append(index)
        vals.append(counts / counts.sum())
    base = torch.tensor(embedder.table, dtype=torch.float32)
    target = torch.tensor(contextual)
    components, cosines = np.zeros_like(v3["components"]), []
    for k in np.unique(fold):
        train, test = np.nonzero(fold != k)[0], np.nonzero(fold == k)[0]

        def mean_rows(idx: np.ndarray):
            keep = np.isin(np.concatenate(rows), idx)
            renumber = np.full(len(data), -1)
            renumber[idx] = np.arange(len(idx))
            coo = torch.sparse_coo_tensor(
                torch.tensor(np.stack([renumber[np.concatenate(rows)[keep]], np.concatenate(cols)[keep]])),
                torch.tensor(np.concatenate(vals)[keep], dtype=torch.float32),
                (len(idx), base.shape[0]),
            )
            return coo.coalesce().to_sparse_csr()

        table = learned_table(mean_rows(train), target[train], base, l2=3e-5)
        pooled = (mean_rows(np.arange(len(data))) @ table).numpy()
        pooled /= np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-9)
        cosines.append(float((pooled[test] * contextual[test]).sum(1).mean()))
        enc_k = Encoded(enc.token_ids, pooled.astype(np.float32), enc.length, enc.options)
        head = _fit_parts(data.subset(train), enc_k.subset(train), TrainConfig(calibration_folds=0))
        components[test] = head.components(enc_k.subset(test))
    print(
        f"  learned table: held-out cosine to the full encoder {np.mean(cosines):.3f} "
        f"(the [CLS] token [SEP] table: {float((enc.static * contextual).sum(1).mean()):.3f})"
    )
    report("v3 recipe on a learned static table (per fold)", equal_blend(components, fold), ref)

    torch.set_num_threads(1)
    print("\nfull encoder, one prompt, one core (ms per forward pass)")
    lengths = np.array([len(ids) + 2 for ids in enc.token_ids])
    for tokens in (16, 72, 128, 256):
        ids = torch.randint(1000, 20000, (1, tokens))
        mask = torch.ones_like(ids, dtype=torch.bool)
        with torch.inference_mode():
            for _ in range(3):
                model.forward(ids, mask)
            t0 = time.perf_counter()
            for _ in range(20):
                model.forward(ids, mask)
        share = (np.minimum(lengths, 256) <= tokens).mean()
        print(
            f"  {tokens:>4} tokens: {(time.perf_counter() - t0) / 20 * 1000:6.1f} ms  ({share:.0%} of prompts this long or shorter)"
        )


def encode_by_depth(model, prompts: list[str], batch_size: int = 32) -> np.ndarray:
    """(layers, prompts, dim): each prompt's pooled embedding after every layer, in input order."""
    import torch

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out = np.zeros((len(model.layers), len(prompts), model.dim), dtype=np.float32)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        ids, mask = model.tokenize([prompts[i] for i in idx])
        out[:, idx] = torch.stack(model.pooled_by_depth(ids, mask)).numpy()
    return out


def depth(
    data: Outcomes,
    enc: Encoded,
    fold: np.ndarray,
    report,
    tokens: list[int],
    depths: list[int],
    cache: Path | None,
    compute: str = "float32",
    threads: int | None = None,
) -> None:
    """Experiment 8: the v3 head on embeddings pooled after MiniLM's first layers, inputs cut short."""
    import torch

    from routing.minilm import MiniLMEncoder

    torch.set_num_threads(threads or os.cpu_count() or 1)
    v3 = cross_fitted(data, enc, fold, TrainConfig(calibration_folds=0))
    ref = equal_blend(v3["components"], fold)
    report("v3 recipe (static MiniLM table)", ref, None)
    groups = sorted(set(data.groups or []))
    truth = np.array([groups.index(g) for g in data.groups or []])
    for t in tokens:
        path = cache / f"minilm-depth-{t}-{compute}.npy" if cache else None
        if path and path.exists():
            by_depth = np.load(path)
        else:
            t0 = time.perf_counter()
            model = MiniLMEncoder(max_tokens=t, num_layers=max(depths), compute=compute)
            # int8 quantizes activations per tensor: one prompt a pass, as the router runs it.
            by_depth = encode_by_depth(model, data.prompts, batch_size=1 if compute == "int8" else 32)
            print(
                f"{len(data)} prompts encoded at {t} tokens in {time.perf_counter() - t0:.0f} s", flush=True
            )
            if path:
                np.save(path, by_depth)
        for layers in depths:
            emb = by_depth[layers - 1]
            out = cross_fitted(
                data,
                Encoded(enc.token_ids, emb, enc.length, enc.options),
                fold,
                TrainConfig(calibration_folds=0),
            )
            right = (out["posterior"].argmax(1) == truth).mean()
            report(
                f"{layers} layers, {t} tokens, {compute} (subject right {right:.3f})",
                equal_blend(out["components"], fold),
                ref,
            )


def reporter(data: Outcomes, bootstrap: int):
    """`report(name, score, ref, vs)`: prints a ranking's APGR with a 95% bootstrap interval and, given a
    reference ranking, the paired bootstrap interval of the difference (the same draws for every call)."""
    w, s = data.weak.astype(float), data.strong.astype(float)
    rng = np.random.default_rng(0)
    draws = [rng.integers(0, len(data), len(data)) for _ in range(bootstrap)]

    def apgr(score: np.ndarray) -> float:
        return metrics(score, w, s)["APGR"]

    def report(name: str, score: np.ndarray, ref: np.ndarray | None, vs: str = "v3") -> None:
        boot = [metrics(score[i], w[i], s[i])["APGR"] for i in draws]
        line = f"  {name:<62} APGR {apgr(score):.4f} [{np.percentile(boot, 2.5):.3f}, {np.percentile(boot, 97.5):.3f}]"
        if ref is not None:
            diff = [b - metrics(ref[i], w[i], s[i])["APGR"] for b, i in zip(boot, draws, strict=True)]
            line += f"  vs {vs} {apgr(score) - apgr(ref):+.4f} [{np.percentile(diff, 2.5):+.4f}, {np.percentile(diff, 97.5):+.4f}]"
        print(line, flush=True)

    return report


def main() -> None:
    from sklearn.ensemble import HistGradientBoostingRegressor
    from sklearn.linear_model import Ridge

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/routing-mmlu"
    )
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--seeds", type=int, default=3, help="seeds of the wider network")
    ap.add_argument("--artefact-only", action="store_true", help="only experiment 5 (the label artefact)")
    ap.add_argument("--ceiling-only", action="store_true", help="only experiment 6 (the room left)")
    ap.add_argument("--encoder-only", action="store_true", help="only experiment 7 (the full encoder)")
    ap.add_argument("--depth-only", action="store_true", help="only experiment 8 (shallow, short encoders)")
    ap.add_argument("--depths", default="1,2,3,4,6", help="experiment 8: encoder layers to try")
    ap.add_argument("--max-tokens", default="64,128,256", help="experiment 8: input caps to try")
    ap.add_argument("--compute", default="float32", help="experiment 8: float32, bfloat16 or int8 matmuls")
    ap.add_argument("--cache", type=Path, help="experiment 8: keep the encoded prompts here between runs")
    ap.add_argument(
        "--threads", type=int, help="experiment 8: torch threads (default: one per core; 1 on a busy machine)"
    )
    args = ap.parse_args()

    data = load_mmlu(args.data)
    w, s = data.weak.astype(float), data.strong.astype(float)
    gain = s - w
    embedder = StaticEmbedder.from_minilm()
    enc = encode(embedder, data.prompts)
    fold = np.array([prompt_fold(p, 5) for p in data.prompts])
    report = reporter(data, args.bootstrap)

    def apgr(score: np.ndarray) -> float:
        return metrics(score, w, s)["APGR"]

    if args.artefact_only:
        artefact(data, enc, fold, report, embedder)
        return
    if args.ceiling_only:
        ceiling(data, enc, fold, report, embedder)
        return
    if args.encoder_only:
        encoder(data, enc, fold, report, embedder)
        return
    if args.depth_only:
        depths = [int(v) for v in args.depths.split(",")]
        tokens = [int(v) for v in args.max_tokens.split(",")]
        depth(data, enc, fold, report, tokens, depths, args.cache, args.compute, args.threads)
        return
    t0 = time.perf_counter()
    v3 = cross_fitted(data, enc, fold, TrainConfig(calibration_folds=0))
    print(f"v3 components cross-fitted in {time.perf_counter() - t0:.0f} s; load {os.getloadavg()[0]:.1f}")
    sparse = v3["components"][:, 2]
    ref = equal_blend(v3["components"], fold)
    report("v3 recipe (equal blend of group, network, sparse)", ref, None)

    def ridge_group(posterior: np.ndarray) -> np.ndarray:
        return across_folds(lambda: Ridge(alpha=1.0), posterior, gain, fold)

    group = ridge_group(v3["posterior"])
    report(
        "v3, group term = ridge map of the posterior",
        equal_blend(np.column_stack([group, v3["components"][:, 1:]]), fold),
        ref,
    )

    wide = []
    for seed in range(args.seeds):
        t0 = time.perf_counter()
        cfg = TrainConfig(calibration_folds=0, sparse_buckets=0, hidden=512, seed=seed)
        r = cross_fitted(data, enc, fold, cfg)
        wide.append(r)
        print(
            f"hidden 512, seed {seed}: cross-fitted in {time.perf_counter() - t0:.0f} s; load {os.getloadavg()[0]:.1f}"
        )
        report(f"hidden 512 seed {seed}", equal_blend(np.column_stack([r["components"], sparse]), fold), ref)
        parts = np.column_stack([ridge_group(r["posterior"]), r["components"][:, 1], sparse])
        report(f"hidden 512 seed {seed}, ridge-mapped group term", equal_blend(parts, fold), ref)
    comps = np.mean([r["components"] for r in wide], axis=0)
    posterior = np.mean([r["posterior"] for r in wide], axis=0)
    parts = np.column_stack([ridge_group(posterior), comps[:, 1], sparse])
    blend = equal_blend(parts, fold)
    report(f"hidden 512, {args.seeds} seeds averaged, ridge-mapped group term", blend, ref)

    structure = np.stack([structure_features(p) for p in data.prompts])
    groups = np.array(data.groups)
    print("\nstructure features: correlation with the gain within subjects (both centred per subject)")
    y = gain.copy()
    x = structure.astype(float).copy()
    for g in np.unique(groups):
        rows = groups == g
        y[rows] -= y[rows].mean()
        x[rows] -= x[rows].mean(axis=0)
    for j, name in enumerate(STRUCTURE):
        r = np.corrcoef(x[:, j], y)[0, 1] if x[:, j].std() > 0 else 0.0
        print(f"  {name:<32} r = {r:+.4f}  (mean {structure[:, j].mean():.3f})")

    def zscore(v: np.ndarray) -> np.ndarray:
        return (v - v.mean()) / v.std()

    log_len = np.log1p([len(p) for p in data.prompts])[:, None]
    hgb = dict(
        max_iter=300, learning_rate=0.03, max_leaf_nodes=15, min_samples_leaf=200, l2_regularization=1.0
    )
    for name, x in (
        ("[components, length, posterior]", np.hstack([parts, log_len, posterior])),
        ("[components, length, structure, posterior]", np.hstack([parts, log_len, structure, posterior])),
    ):
        stack = across_folds(lambda: HistGradientBoostingRegressor(random_state=0, **hgb), x, gain, fold)
        report(f"HGB on gain {name}", stack, ref)
        report("  1:1 with the blend above", zscore(blend) + zscore(stack), ref)

    print(
        "\nnon-MMLU probe: shipped head's logit plus lambda x a length or rarity score (both z-scored on MMLU)"
    )
    clf = DifficultyClassifier.default()
    vocab = {v: k for k, v in embedder.tokenizer.get_vocab().items()}

    def extra(prompt: str) -> dict[str, float]:
        pieces = [vocab[t] for t in embedder.token_ids(prompt)]
        words = sum(not p.startswith("##") for p in pieces)
        split = prompt.split()
        return {
            "log length": math.log1p(len(prompt)),
            "word pieces per word": (len(pieces) - words) / max(words, 1),
            "share of words >= 9 letters": float(np.mean([len(t) >= 9 for t in split])) if split else 0.0,
        }

    def logit(p: np.ndarray) -> np.ndarray:
        return np.log(p / (1 - p))

    head_mmlu = logit(np.array(clf.score_many(data.prompts[::7])))
    mu, sd = head_mmlu.mean(), head_mmlu.std()
    probe = {k: [p for _, p in rows] for k, rows in PROBE.items()}
    head_probe = {k: (logit(np.array(clf.score_many(v))) - mu) / sd for k, v in probe.items()}
    mmlu_x = [extra(p) for p in data.prompts]
    probe_x = {k: [extra(p) for p in v] for k, v in probe.items()}
    for feature in mmlu_x[0]:
        m = np.array([e[feature] for e in mmlu_x])
        fm, fs = m.mean(), m.std()
        fx = {k: (np.array([e[feature] for e in v]) - fm) / fs for k, v in probe_x.items()}
        print(f"  {feature}: alone MMLU APGR {apgr(m):.4f}, probe AUC {auc(fx['hard'], fx['easy']):.2f}")
        for lam in (0.0, 0.25, 0.5, 1.0, 2.0):
            mixed = zscore(ref) + lam * (m - fm) / fs
            probe_auc = auc(head_probe["hard"] + lam * fx["hard"], head_probe["easy"] + lam * fx["easy"])
            print(f"    lambda {lam:<4} MMLU APGR {apgr(mixed):.4f}  probe AUC {probe_auc:.2f}")
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
