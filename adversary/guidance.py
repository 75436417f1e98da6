"""Discriminator-guided decoding: sample K turns per context, keep one by the discriminator's verdict.

`resample` is self-normalised importance resampling: with a calibrated discriminator D = P(real | x) trained on
balanced data, w = D / (1 - D) = exp(log-odds) estimates p_real(x) / p_sim(x), so drawing one of K candidates with
probability w_i / sum w moves the simulator's distribution toward the real one as K grows (the residual-EBM target;
docs/results.md has the measured effect). `argmax` keeps the most real-looking candidate: the contrast case, known to
cut diversity.
"""

from __future__ import annotations

import numpy as np

RULES = ("resample", "argmax")


def choose(logodds: np.ndarray, rule: str, rng: np.random.Generator) -> np.ndarray:
    """Index of the kept candidate per row. logodds: (n, K) calibrated log-odds of "real" -> (n,) ints."""
    z = np.asarray(logodds, dtype=np.float64)
    if z.ndim != 2 or z.shape[1] < 1:
        raise ValueError(f"logodds must be (n, K) with K >= 1, got shape {z.shape}")
    if rule == "argmax":
        return z.argmax(1)
    if rule != "resample":
        raise ValueError(f"unknown rule {rule!r} (choose from {', '.join(RULES)})")
    w = np.exp(z - z.max(1, keepdims=True))  # (n, K), the row's largest weight is 1: no overflow
    cdf = np.cumsum(w / w.sum(1, keepdims=True), axis=1)
    u = rng.random((z.shape[0], 1))
    return np.minimum((cdf < u).sum(1), z.shape[1] - 1)


def effective_sample_size(logodds: np.ndarray) -> np.ndarray:
    """Kish's effective sample size of each row's importance weights, (n, K) -> (n,): K when D cannot tell the
    candidates apart, 1 when one of them takes all the weight."""
    z = np.asarray(logodds, dtype=np.float64)
    w = np.exp(z - z.max(1, keepdims=True))
    return w.sum(1) ** 2 / (w ** 2).sum(1)
