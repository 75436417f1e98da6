"""Calibration of a real-vs-simulated scorer, so that its probability can be read as a density ratio.

A discriminator D trained on balanced real and simulated turns estimates D(x) = p_real(x) / (p_real(x) + p_sim(x)),
so w(x) = D / (1 - D) = exp(log-odds) is the importance weight that turns the simulator's distribution into the real
one (the residual-EBM reading: Deng et al. 2020, Bakhtin et al. 2021). That reading holds only for a calibrated D:
`PlattScaler` refits the log-odds' scale and offset on pairs the discriminator was not trained on, and
`expected_calibration_error` says how far the probabilities are from the frequencies, before and after.
"""

from __future__ import annotations

import numpy as np


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-np.asarray(z, dtype=np.float64)))


def expected_calibration_error(prob, labels, bins: int = 10) -> float:
    """ECE of probabilities of label 1: sum over equal-width bins of (share of items) x |frequency - mean
    probability|. Empty bins count nothing; a probability of exactly 1 falls in the last bin."""
    p, y = np.asarray(prob, dtype=np.float64), np.asarray(labels, dtype=np.float64)
    if p.shape != y.shape or p.ndim != 1 or not len(p):
        raise ValueError("prob and labels must be 1-D arrays of the same non-zero length")
    idx = np.minimum((p * bins).astype(np.int64), bins - 1)  # [n] bin of each item
    n = np.bincount(idx, minlength=bins).astype(np.float64)
    conf = np.bincount(idx, weights=p, minlength=bins)
    freq = np.bincount(idx, weights=y, minlength=bins)
    full = n > 0
    return float(np.sum(np.abs(freq[full] - conf[full])) / len(p))


class PlattScaler:
    """log-odds -> a * log-odds + b, fitted by logistic regression (sklearn, no penalty) on held-out items."""

    def __init__(self):
        self.a, self.b = 1.0, 0.0

    def fit(self, scores, labels) -> "PlattScaler":
        from sklearn.linear_model import LogisticRegression

        s = np.asarray(scores, dtype=np.float64).reshape(-1, 1)
        lr = LogisticRegression(C=1e6).fit(s, np.asarray(labels))
        self.a, self.b = float(lr.coef_[0, 0]), float(lr.intercept_[0])
        return self

    def __call__(self, scores) -> np.ndarray:
        return self.a * np.asarray(scores, dtype=np.float64) + self.b

    def prob(self, scores) -> np.ndarray:
        return _sigmoid(self(scores))

    def to_dict(self) -> dict:
        return {"a": self.a, "b": self.b}


def calibration_report(scores, labels, scaler: PlattScaler | None = None, bins: int = 10) -> dict:
    """ECE, log-loss and accuracy of raw log-odds, and after `scaler` when one is given."""
    from sklearn.metrics import log_loss

    y = np.asarray(labels)
    out = {}
    for name, z in (("raw", np.asarray(scores, dtype=np.float64)),) + ((("calibrated", scaler(scores)),) if scaler else ()):
        p = np.clip(_sigmoid(z), 1e-7, 1 - 1e-7)
        out[name] = {"ece": expected_calibration_error(p, y, bins), "log_loss": float(log_loss(y, p, labels=[0, 1])),
                     "accuracy": float(np.mean((z > 0) == (y == 1)))}
    return out
