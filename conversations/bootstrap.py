"""The one bootstrap of the project: resampling groups with replacement as multinomial counts, and percentile
intervals. The meter (`discriminator.turing`: accuracies with items of one context resampled together), the study's
paired differences (contexts resampled jointly across arms) and the agent scores (`agent_rl.stats`: episodes
resampled within each gym) all draw their resamples here, with a fixed seed.

It lives in the data layer so that every package above can use it; it needs numpy only.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

LEVEL = 0.95


def resample_counts(n_groups: int, n_boot: int, seed: int = 0, rng: np.random.Generator | None = None) -> np.ndarray:
    """(n_boot, n_groups): how often each group is drawn in each resample; each resample draws n_groups groups.
    `rng` (instead of `seed`): draw from a generator the caller shares across several calls."""
    if n_groups < 1 or n_boot < 1:
        raise ValueError(f"need n_groups >= 1 and n_boot >= 1, got {n_groups}, {n_boot}")
    rng = rng if rng is not None else np.random.default_rng(seed)
    return rng.multinomial(n_groups, np.full(n_groups, 1.0 / n_groups), size=n_boot).astype(np.float64)


def percentile_ci(samples: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(np.asarray(samples, dtype=np.float64), [a, 1.0 - a])
    return float(lo), float(hi)


def stratified_means(strata: Sequence[np.ndarray], n_boot: int, seed: int = 0) -> np.ndarray:
    """(n_boot, S): the mean of each stratum's values under resampling within the stratum (one seed for all, the
    strata drawn one after the other)."""
    rng = np.random.default_rng(seed)
    out = []
    for values in strata:
        v = np.asarray(values, dtype=np.float64)
        out.append(resample_counts(len(v), n_boot, rng=rng) @ v / len(v))  # (n_boot,)
    return np.stack(out, axis=1)


def pooled_panel_td(correct: list, ctx: list, counts: np.ndarray) -> np.ndarray:
    """Bootstrap distribution [B] of a panel td that is the mean over sampling seeds: correct[s] (D, n) booleans
    (detector right on item) of seed s, ctx[s] (n,) each item's context index, counts (B, n_ctx) how often each
    context is drawn in each resample (the same resample for every seed, so differences between conditions pair)."""
    out = np.zeros(len(counts))
    for c, ix in zip(correct, ctx):
        w = counts[:, ix].astype(np.float64)  # (B, n)
        acc = 100.0 * (w @ np.asarray(c, dtype=np.float64).T) / w.sum(1)[:, None]  # (B, D)
        out += np.abs(acc - 50.0).max(1)
    return out / len(correct)
