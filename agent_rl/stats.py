"""Scores, confidence intervals and the paired bootstrap, on episode returns.

UserRL's score: per gym, the mean over episodes of the summed turn rewards x 100; overall = the mean over gyms
(unweighted). CIs are 95% percentile bootstraps with a fixed seed; the overall one resamples episodes within each gym
(stratified), so every resample keeps all gyms.

Not `scipy.stats.bootstrap(paired=True)`: it resamples one flat sample, not episodes within each gym (the stratified
overall score), and the reported CIs were drawn from `conversations.bootstrap`'s one seeded stream.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from conversations.bootstrap import percentile_ci, stratified_means

SCALE = 100.0
N_BOOT = 2000


def mean_ci(values: Sequence[float], seed: int = 0, n_boot: int = N_BOOT) -> tuple[float, float, float]:
    """(mean, ci_low, ci_high) of `values` x 100."""
    v = np.asarray(values, dtype=float) * SCALE
    if v.size == 0:
        return float("nan"), float("nan"), float("nan")
    if v.size == 1:
        return float(v[0]), float(v[0]), float(v[0])
    return (float(v.mean()), *percentile_ci(stratified_means([v], n_boot, seed)[:, 0]))


def overall_ci(per_gym: Mapping[str, Sequence[float]], seed: int = 0, n_boot: int = N_BOOT):
    """(mean over gyms of the per-gym mean, ci_low, ci_high), x 100, stratified bootstrap."""
    gyms = [np.asarray(v, dtype=float) * SCALE for v in per_gym.values() if len(v)]
    if not gyms:
        return float("nan"), float("nan"), float("nan")
    point = float(np.mean([g.mean() for g in gyms]))
    return (point, *percentile_ci(stratified_means(gyms, n_boot, seed).mean(axis=1)))


def paired_delta_ci(per_gym_pairs: Mapping[str, tuple[Sequence[float], Sequence[float]]], seed: int = 0,
                    n_boot: int = N_BOOT):
    """Overall delta (B - A) x 100 with a paired bootstrap CI: per gym, the same resampled task indices for both
    agents, so the task-to-task spread (which both agents share) cancels out of the interval."""
    diffs = []
    for a, b in per_gym_pairs.values():
        a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
        if a.shape != b.shape:
            raise ValueError("paired values must have the same length")
        if a.size:
            diffs.append((b - a) * SCALE)
    if not diffs:
        return float("nan"), float("nan"), float("nan")
    point = float(np.mean([d.mean() for d in diffs]))
    return (point, *percentile_ci(stratified_means(diffs, n_boot, seed).mean(axis=1)))
