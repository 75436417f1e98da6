"""`objective: bond`: best-of-N distillation (BOND, Sessa et al. 2024), iterated with a moving anchor (J-BOND's
form, the anchor being the policy at the round's start) and the calibrated discriminator as the reward.

The best-of-K distribution of the anchor has density pi_BoK(x) = pi(x) K F(x)^(K-1), F the reward's CDF under the
anchor. Each round (adversary.distill.DistillRounds): K own samples per context, F estimated by each sample's rank
among its context's K (F_i = (1 + #{j != i: z_j <= z_i}) / K; an empty or cut sample ranks last), then the Jeffreys
mixture of BOND's two terms, `bond_beta` weighing the second:
- forward KL(pi_BoK || pi): the NLL of the best of K (SFT on best-of-N samples);
- backward KL(pi || pi_BoK): a policy gradient with the reward (K-1) log F_i, centred over the context's K and
  scaled by K / ((K-1) log K) so that its coefficients sit in the range of the forward term's.
The contexts' real turns keep their NLL term (`distill_real_weight`).
"""

from __future__ import annotations

import numpy as np

from adversary.distill import DistillRounds
from adversary.objectives import register


def quantiles(z: np.ndarray, usable: np.ndarray) -> np.ndarray:
    """(n, K) F_i = (1 + #{j != i: z_j <= z_i}) / K within each row; an unusable sample scores below every usable one
    (ties among them count each other)."""
    s = np.where(usable, z, -np.inf)
    K = s.shape[1]
    le = (s[:, None, :] <= s[:, :, None]).sum(2) - 1  # (n, K): others at or below
    return (1.0 + le) / K


def bond_coefficients(z: np.ndarray, usable: np.ndarray, beta: float) -> np.ndarray:
    """(n, K) c_i = (1 - beta) 1[i is the best usable] + beta K (R_i - mean R) / ((K-1) log K), R = (K-1) log F_i."""
    K = z.shape[1]
    R = (K - 1) * np.log(quantiles(z, usable))
    back = K * (R - R.mean(1, keepdims=True)) / ((K - 1) * np.log(K))
    best = np.zeros_like(z, dtype=np.float64)
    rows = np.flatnonzero(usable.any(1))
    best[rows, np.where(usable, z, -np.inf)[rows].argmax(1)] = 1.0
    return (1.0 - beta) * best + beta * back


@register("bond")
class Bond(DistillRounds):
    owns = DistillRounds.owns + ("bond_beta",)

    def coefficients(self, z, usable, contexts, samples):
        coef = bond_coefficients(z, usable, self.phase.cfg.bond_beta)
        best = np.where(usable, z, -np.inf).max(1)
        ok = np.isfinite(best)
        return coef, {"round/best_score_mean": float(np.mean(best[ok])) if ok.any() else None}
