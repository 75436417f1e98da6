"""The Turing-distance meter. Definition and protocol: docs/turing-distance.md.

    TD = |acc - 50|, acc = out-of-fold accuracy (percent) of a fresh detector on a balanced set of real and simulated
    user turns. 0: the detector does no better than chance. 50: every turn is caught.

`measure_td` cross-fits every detector of a panel on grouped folds (no context, no conversation lineage and no
duplicate turn text on both sides of a split), scores the held-out fold, and reports each detector's accuracy, AUC, TD
with a group-bootstrap 95% interval, and the paired (same-context) accuracy. The headline TD is the panel's maximum.
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from typing import Any, Callable, Sequence

import numpy as np

from conversations import DataError, TurnRecord
from conversations.bootstrap import percentile_ci, resample_counts
from discriminator.features import has_context, normalise_turn_text  # noqa: F401 (has_context: callers)
from discriminator.registry import _REGISTRY, detector_names, make_detector, register_detector  # noqa: F401

MIN_ITEMS = 20
# the language-model judge (discriminator.lm_judge) joined the panel on 2026-12-07; every report keeps the panel
# before it (`old_panel`) beside the headline, so curves read before that date stay comparable
DEFAULT_PANEL = ("classical", "style", "neural", "lmjudge")
OLD_PANEL = ("classical", "style", "neural", "embed")  # the families that read td before the judge
FAST_PANEL = ("classical", "style")
# with both `lmjudge` and `classical` in a panel, the meter also reads their mean in log-odds (no fit of its own):
# the judge as the main job uses it beside its n-gram member (`disc_family: lmjudge`, `disc_weights: [1, 1]`), which
# reads same-context pairs better than either alone (docs/studies/lm-judge.md)
JUDGE_NGRAM = "judge+ngram"
# the neural detector inside the meter: short inputs and a higher learning rate so that a 5-fold fit on 2 x 1,000
# turns stays within minutes on CPU; callers override through `neural_kwargs`
NEURAL_PANEL_DEFAULTS = {"max_length": 128, "context_tokens": 48, "lr": 5e-5, "batch_size": 16, "epochs": 1}
# the judge inside the meter: a fresh LoRA adapter and head on SmolLM2-135M per fold (docs/turing-distance.md)
LMJUDGE_PANEL_DEFAULTS = {"max_length": 160, "context_tokens": 64, "batch_size": 16, "epochs": 1}


# --------------------------------------------------------------------------------------------------------------------
# pure helpers


def turing_distance(acc: float) -> float:
    """TD from an accuracy in percent: |acc - 50|."""
    return abs(float(acc) - 50.0)


def accuracy(scores: np.ndarray, labels: np.ndarray) -> float:
    """Percent of items on the right side of log-odds 0 (score > 0 means "real"; a tie counts as "simulated")."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels)
    return float(100.0 * np.mean((scores > 0).astype(np.int64) == labels))


def bootstrap_accuracies(
    correct: np.ndarray, groups: np.ndarray | None = None, n_boot: int = 1000, seed: int = 0
) -> np.ndarray:
    """Bootstrap accuracies (percent), resampling whole groups with replacement.

    correct: [n] or [D, n] booleans (one row per detector; all rows share the resamples, so a statistic across
    detectors, such as the panel maximum, is bootstrapped jointly). Returns [n_boot] or [n_boot, D]."""
    c = np.atleast_2d(np.asarray(correct, dtype=np.float64))  # [D, n]
    n = c.shape[1]
    if n == 0:
        raise ValueError("bootstrap of an empty set")
    g = np.arange(n) if groups is None else np.unique(np.asarray(groups), return_inverse=True)[1].reshape(-1)
    G = int(g.max()) + 1
    group_correct = np.stack([np.bincount(g, weights=row, minlength=G) for row in c])  # [D, G]
    group_n = np.bincount(g, minlength=G).astype(np.float64)  # [G]
    W = resample_counts(G, n_boot, seed)  # [n_boot, G]: how often group j is drawn in resample b
    accs = 100.0 * (W @ group_correct.T) / (W @ group_n)[:, None]  # [n_boot, D]
    return accs[:, 0] if np.ndim(correct) == 1 else accs


def bootstrap_ci(
    correct: np.ndarray,
    groups: np.ndarray | None = None,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
    statistic: Callable[[np.ndarray], np.ndarray] | None = None,
) -> tuple[float, float]:
    """Percentile interval of a statistic of the bootstrapped accuracy; by default TD = |acc - 50|.

    correct: [n] booleans (1 = the detector got the item right). With groups, whole groups are resampled (items that
    share a context are not independent). For [D, n] input, `statistic` maps [n_boot, D] accuracies to [n_boot]."""
    accs = bootstrap_accuracies(correct, groups, n_boot, seed)
    if statistic is None:
        stat = np.abs(accs - 50.0)
        if stat.ndim == 2:
            stat = stat.max(axis=1)
    else:
        stat = np.asarray(statistic(accs))
    return percentile_ci(stat, level)


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(np.asarray(labels), np.asarray(scores, dtype=np.float64)))


def _chain(h: bytes, role: str, content: str) -> bytes:
    return hashlib.sha1(h + role.encode() + b"\x00" + content.encode("utf-8", "surrogatepass") + b"\x01").digest()


def fold_groups(items: Sequence[TurnRecord]) -> np.ndarray:
    """Group id per item [n]: connected components of "must not be split" links.

    Two items are linked when they share a (non-empty) context (`context_key`), when their turns are the same text up
    to case and whitespace, or when one's context contains the other's context and turn (two turns of one
    conversation: the later item's context holds the earlier turn verbatim)."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    n = len(items)
    edges: list[tuple[int, int]] = []
    first_by_key: dict[Any, int] = {}

    def link(key: Any, i: int) -> None:
        j = first_by_key.setdefault(key, i)
        if j != i:
            edges.append((i, j))

    # hash chains over messages: prefix hash after each user message of a context, and the item's context + turn
    prefixes: list[list[bytes]] = []
    full: list[bytes] = []
    for i, it in enumerate(items):
        if has_context(it):
            link(("ctx", it.context_key), i)
        link(("text", normalise_turn_text(it.user_turn)), i)
        h, pre = b"", []
        for m in it.context:
            h = _chain(h, m["role"], m["content"])
            if m["role"] == "user":
                pre.append(h)
        prefixes.append(pre)
        full.append(_chain(h, "user", it.user_turn))
    by_full: dict[bytes, int] = {}
    for i, f in enumerate(full):
        by_full.setdefault(f, i)
    for i, pre in enumerate(prefixes):
        for h in pre:
            j = by_full.get(h)
            if j is not None:
                edges.append((i, j))
    if not n:
        return np.zeros(0, dtype=np.int64)
    rows, cols = (np.array(x, dtype=np.int64) for x in zip(*edges)) if edges else (np.zeros(0, np.int64),) * 2
    graph = coo_matrix((np.ones(len(rows)), (rows, cols)), shape=(n, n))
    # components numbered in order of their lowest item, as the folds have always been assigned
    return connected_components(graph, directed=False)[1].astype(np.int64)


def grouped_folds(
    items: Sequence[TurnRecord], folds: int = 5, seed: int = 0, labels: Sequence[int] | None = None
) -> np.ndarray:
    """Fold id in [0, folds) per item [n], such that every group of `fold_groups` lies in one fold.

    Groups are placed largest first (ties in a seeded random order), each into the fold where it keeps the per-label
    counts most even (sum of squared counts), so folds come out near equal in size and label balance."""
    if folds < 2:
        raise DataError(f"need at least 2 folds, got {folds}")
    groups = fold_groups(items)
    n_groups = int(groups.max()) + 1 if len(groups) else 0
    if n_groups < folds:
        raise DataError(
            f"only {n_groups} independent group(s) of items (items that share a context, a conversation or a turn "
            f"text stay together); need at least {folds} for {folds} folds"
        )
    y = np.zeros(len(items), dtype=np.int64) if labels is None else np.asarray(labels, dtype=np.int64)
    L = int(y.max()) + 1
    counts = np.zeros((n_groups, L), dtype=np.int64)  # [G, L]
    np.add.at(counts, (groups, y), 1)
    rng = np.random.default_rng(seed)
    order = rng.permutation(n_groups)
    order = order[np.argsort(-counts[order].sum(1), kind="stable")]
    load = np.zeros((folds, L), dtype=np.int64)  # [F, L]
    assign = np.empty(n_groups, dtype=np.int64)
    for g in order:
        cost = ((load + counts[g]) ** 2).sum(1)  # [F]
        f = int(np.argmin(cost))
        assign[g] = f
        load[f] += counts[g]
    return assign[groups]


def paired_accuracy(
    scores: np.ndarray, labels: np.ndarray, items: Sequence[TurnRecord]
) -> tuple[float | None, int]:
    """Two-alternative accuracy (percent) over contexts that hold both a real and a simulated turn: within a context,
    the share of (real, simulated) pairs where the real turn scores as more human (ties count half), averaged over
    contexts. Returns (None, 0) when no context is shared. Empty contexts do not pair (they are not one context)."""
    by_ctx: dict[str, list[int]] = defaultdict(list)
    for i, it in enumerate(items):
        if has_context(it):
            by_ctx[it.context_key].append(i)
    s, y = np.asarray(scores, dtype=np.float64), np.asarray(labels)
    per_ctx = []
    for idx in by_ctx.values():
        idx = np.asarray(idx)
        r, f = s[idx[y[idx] == 1]], s[idx[y[idx] == 0]]
        if len(r) and len(f):
            diff = r[:, None] - f[None, :]  # [n_real, n_sim] in this context
            per_ctx.append(float(np.mean((diff > 0) + 0.5 * (diff == 0))))
    if not per_ctx:
        return None, 0
    return 100.0 * float(np.mean(per_ctx)), len(per_ctx)


def balance_items(
    real: Sequence[TurnRecord], sim: Sequence[TurnRecord], seed: int = 0
) -> tuple[list[TurnRecord], list[TurnRecord]]:
    """Sample the larger side down to the smaller one's size, with a fixed seed. Items whose context also appears on
    the other side are kept first, so pairs survive (the choice looks at contexts only, never at the turns)."""
    real, sim = list(real), list(sim)
    if len(real) == len(sim):
        return real, sim
    big, small = (real, sim) if len(real) > len(sim) else (sim, real)
    other = {it.context_key for it in small if has_context(it)}
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(big))
    unpaired = np.array([not (has_context(big[i]) and big[i].context_key in other) for i in perm], dtype=bool)
    keep = np.sort(perm[np.argsort(unpaired, kind="stable")][: len(small)])
    picked = [big[i] for i in keep]
    return (picked, small) if big is real else (small, picked)


# --------------------------------------------------------------------------------------------------------------------
# the meter


def _detector_kwargs(name: str, seed: int, neural_kwargs: dict | None, detector_kwargs: dict | None) -> dict:
    kw: dict[str, Any] = {"seed": seed}
    if name == "neural":
        kw.update(NEURAL_PANEL_DEFAULTS)
        kw.update(neural_kwargs or {})
    elif name == "lmjudge":
        kw.update(LMJUDGE_PANEL_DEFAULTS)
    kw.update((detector_kwargs or {}).get(name, {}))
    return kw


def cross_fit(name: str, kw: dict, items: Sequence[TurnRecord], y: np.ndarray, fold_of: np.ndarray, folds: int,
              progress: Callable[[str], None] | None = None) -> tuple[np.ndarray, dict[str, float]]:
    """Out-of-fold log-odds [n] of one fresh detector family: fitted on every fold but k, scored on fold k. A
    stateful detector (the neural one) is built once and reset to its untrained state per fold: loading a backbone
    costs seconds, restoring its initial weights and optimiser does not."""
    scores = np.zeros(len(items), dtype=np.float64)
    fit_s = score_s = 0.0
    proto, fresh = None, None
    for k in range(folds):
        train, test = np.flatnonzero(fold_of != k), np.flatnonzero(fold_of == k)
        if progress:
            progress(f"{name}: fold {k + 1}/{folds} (fit {len(train)}, score {len(test)})")
        if proto is not None:
            proto.load_state_dict(fresh)
            det = proto
        else:
            det = make_detector(name, **kw)
            if hasattr(det, "state_dict") and hasattr(det, "load_state_dict"):
                proto, fresh = det, det.state_dict()
        t0 = time.perf_counter()
        det.fit([items[i] for i in train], y[train])
        t1 = time.perf_counter()
        scores[test] = det.score([items[i] for i in test])
        fit_s += t1 - t0
        score_s += time.perf_counter() - t1
    return scores, {"fit_seconds": round(fit_s, 3), "score_seconds": round(score_s, 3)}


def detector_report(scores: np.ndarray, y: np.ndarray, items: Sequence[TurnRecord], groups: np.ndarray, n_boot: int,
                    seed: int) -> dict[str, Any]:
    """One detector's part of the report from its out-of-fold scores."""
    from sklearn.metrics import log_loss

    acc = accuracy(scores, y)
    pacc, _ = paired_accuracy(scores, y, items)
    prob = np.clip(1.0 / (1.0 + np.exp(-np.clip(scores, -30, 30))), 1e-7, 1 - 1e-7)
    return {
        "accuracy": acc,
        "auc": roc_auc(scores, y),
        "log_loss": float(log_loss(y, prob, labels=[0, 1])),  # nats; log 2 = 0.693 is a detector that knows nothing
        "td": turing_distance(acc),
        "td_ci95": list(bootstrap_ci((scores > 0) == y, groups, n_boot, seed)),
        "signed": acc - 50.0,
        "paired_accuracy": pacc,
        "paired_td": None if pacc is None else turing_distance(pacc),
    }


def measure_td(
    real_items: Sequence[TurnRecord],
    sim_items: Sequence[TurnRecord],
    detectors: Sequence[str] = DEFAULT_PANEL,
    folds: int = 5,
    seed: int = 0,
    n_boot: int = 1000,
    neural_kwargs: dict | None = None,
    *,
    detector_kwargs: dict[str, dict] | None = None,
    min_items: int = MIN_ITEMS,
    return_scores: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Turing distance of simulated against real user turns, measured out-of-fold by fresh detectors.

    Returns `td` (the panel maximum), `td_ci95` (group bootstrap of that maximum), `signed`,
    `accuracy`, `auc`, `paired_accuracy` (of the headline detector; None without shared contexts), `n_real`,
    `n_simulated`, `headline_detector`, and `detectors: {name: {accuracy, auc, td, td_ci95,
    signed, paired_accuracy, fit_seconds, score_seconds}}`, plus `warnings` (list of str). With `return_scores`, also
    the out-of-fold log-odds, labels, fold and group ids under `oof`. A panel with `lmjudge` and `classical` also
    reports `judge+ngram`, their mean (it joins the maximum)."""
    real_items, sim_items = list(real_items), list(sim_items)
    for side, xs in (("real", real_items), ("simulated", sim_items)):
        if len(xs) < min_items:
            raise DataError(
                f"only {len(xs)} {side} item(s); the meter needs at least {min_items} on each side for a number that "
                f"means anything"
            )
    detectors = list(detectors)
    if not detectors:
        raise DataError("no detectors given")
    for name in detectors:
        if name not in _REGISTRY:
            raise DataError(f"unknown detector {name!r} (choose from {', '.join(_REGISTRY)})")
    n_real_in, n_sim_in = len(real_items), len(sim_items)
    real, sim = balance_items(real_items, sim_items, seed)
    items = real + sim
    y = np.array([1] * len(real) + [0] * len(sim), dtype=np.int64)
    groups = fold_groups(items)
    fold_of = grouped_folds(items, folds, seed, labels=y)
    for k in range(folds):
        # a fold whose training side has one label only cannot fit: happens only with tiny or degenerate inputs
        if len(np.unique(y[fold_of != k])) < 2:
            raise DataError(f"fold {k} leaves only one label to train on; use fewer folds or more items")

    oof = np.zeros((len(detectors), len(items)), dtype=np.float64)  # [D, n] out-of-fold log-odds of real
    per: dict[str, dict[str, Any]] = {}
    for d, name in enumerate(detectors):
        kw = _detector_kwargs(name, seed, neural_kwargs, detector_kwargs)
        oof[d], seconds = cross_fit(name, kw, items, y, fold_of, folds, progress)
        per[name] = {**detector_report(oof[d], y, items, groups, n_boot, seed), **seconds}
    if "lmjudge" in detectors and "classical" in detectors:
        mix = oof[[detectors.index("lmjudge"), detectors.index("classical")]].mean(axis=0)  # [n]
        detectors.append(JUDGE_NGRAM)
        oof = np.vstack([oof, mix[None]])
        per[JUDGE_NGRAM] = {**detector_report(mix, y, items, groups, n_boot, seed), "fit_seconds": 0.0,
                            "score_seconds": 0.0}
    # headline: the strictest judge; ties go to the first in panel order
    tds = [per[n]["td"] for n in detectors]
    head = detectors[int(np.argmax(tds))]
    correct = (oof > 0) == y[None, :]  # [D, n]
    # the interval of the panel maximum: every resample takes the maximum over detectors on the same items
    ci = bootstrap_ci(correct, groups, n_boot, seed) if len(detectors) > 1 else tuple(per[head]["td_ci95"])
    _, n_pairs = paired_accuracy(oof[0], y, items)
    paired = {n: per[n]["paired_td"] for n in detectors if per[n]["paired_td"] is not None}
    # the panel without the judge, its maximum bootstrapped on the same resamples (comparable with earlier readings)
    old = [d for d, n in enumerate(detectors) if n in OLD_PANEL]
    old_panel = None
    if old and len(old) < len(detectors):
        old_head = detectors[max(old, key=lambda d: per[detectors[d]]["td"])]
        old_ci = bootstrap_ci(correct[old], groups, n_boot, seed) if len(old) > 1 else tuple(per[old_head]["td_ci95"])
        old_panel = {"detectors": [detectors[d] for d in old], "td": per[old_head]["td"],
                     "td_ci95": [float(old_ci[0]), float(old_ci[1])], "headline_detector": old_head,
                     "paired_td": max((paired[detectors[d]] for d in old if detectors[d] in paired), default=None)}
    warnings = []
    largest = int(np.bincount(groups).max())
    if largest > len(items) / folds:
        warnings.append(
            f"one group holds {largest} of {len(items)} items (shared contexts, duplicate turn texts or one long "
            f"conversation): its fold is fitted without any item like it; TD may understate"
        )
    for name in detectors:
        rep = per[name]
        if rep["td"] < 5 and abs(rep["auc"] - 0.5) > 0.15:
            warnings.append(f"{name}: AUC {rep['auc']:.3f} but accuracy {rep['accuracy']:.1f}: its threshold is off")
    out: dict[str, Any] = {
        "td": per[head]["td"],
        "td_ci95": [float(ci[0]), float(ci[1])],
        "signed": per[head]["signed"],
        "accuracy": per[head]["accuracy"],
        "auc": per[head]["auc"],
        "log_loss": per[head]["log_loss"],
        "paired_accuracy": per[head]["paired_accuracy"],
        # the panel's maximum of the paired (same-context, two-alternative) td; None without shared contexts
        "paired_td": max(paired.values()) if paired else None,
        "headline_detector": head,
        "old_panel": old_panel,
        "n_real": len(real),
        "n_simulated": len(sim),
        "n_real_input": n_real_in,
        "n_simulated_input": n_sim_in,
        "n_paired_contexts": n_pairs,
        "folds": folds,
        "seed": seed,
        "n_boot": n_boot,
        "n_groups": int(groups.max()) + 1,
        "largest_group": largest,
        "detectors": per,
        "warnings": warnings,
    }
    if return_scores:
        out["oof"] = {
            "scores": {n: oof[d] for d, n in enumerate(detectors)},
            "labels": y,
            "fold": fold_of,
            "group": groups,
            "ids": [it.id for it in items],
        }
    return out


def oof_record(oof: dict) -> dict:
    """The part of `measure_td(..., return_scores=True)["oof"]` that paired differences read, as JSON-ready lists:
    {"labels", "ids", "scores": {detector: log-odds}}."""
    return {"labels": np.asarray(oof["labels"]).tolist(), "ids": list(oof["ids"]),
            "scores": {d: np.asarray(v).tolist() for d, v in oof["scores"].items()}}
