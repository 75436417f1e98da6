"""`objective: dpg`: the distributional policy gradient toward the residual energy model (Parshakova et al. 2019;
Khalifa et al. 2021, GDC): the target is the warm start reweighted by the calibrated discriminator, P(x) ∝ a(x) r(x)
with a = the warm start and r = D/(1-D), the density ratio that guided decoding resamples by (docs/results.md).

Each round (adversary.distill.DistillRounds): K own samples per context from the policy pi itself (T 1, top-p 1),
importance weights w_i ∝ r(x_i) a(x_i) / pi(x_i) self-normalised over the context's K (log a - log pi clipped at
+-`dpg_log_ratio_clip`: the warm start's log-probs come from the adapter switched off), then the policy gradient
sum_i (K w_i - 1) grad log pi(x_i): a baseline of the uniform weight. The a/pi factor is what keeps the target fixed:
iterated SFT on resampled own samples (`resample_sft`) targets pi_t r, which compounds r every round and drifts from
the warm start; here pi moves toward a r and the weights flatten as it gets there (the KL to the warm start is in the
target). The contexts' real turns keep their NLL term (`distill_real_weight`).
"""

from __future__ import annotations

import numpy as np

from adversary.distill import DistillRounds, group_weights, sequence_logprobs
from adversary.objectives import register
from conversations.schema import TurnRecord


@register("dpg")
class DPG(DistillRounds):
    owns = DistillRounds.owns + ("dpg_log_ratio_clip",)

    def coefficients(self, z, usable, contexts, samples):
        from adversary.guidance import effective_sample_size

        ph, cfg = self.phase, self.phase.cfg
        K = z.shape[1]
        recs = [TurnRecord(id=f"{c.id}@own{j}", context=c.context, user_turn=t.text or "...", is_last=t.ended)
                for c, ts in zip(contexts, samples) for j, t in enumerate(ts)]
        kw = dict(precision=cfg.dtype, max_context_tokens=cfg.max_context_tokens, max_length=cfg.warmstart_max_length,
                  batch_size=cfg.warmstart_batch_size * 2)
        log_pi = sequence_logprobs(ph.model, ph.tokenizer, recs, **kw).reshape(z.shape)
        log_a = sequence_logprobs(ph.model, ph.tokenizer, recs, reference=True, **kw).reshape(z.shape)
        clip = cfg.dpg_log_ratio_clip
        ratio = np.clip(log_a - log_pi, -clip, clip)  # (n_ctx, K) log a/pi: 0 while the adapter is untrained
        logw = np.where(usable, z + ratio, -np.inf)
        w = group_weights(logw)  # (n_ctx, K), rows sum to 1 (a row with no usable sample: 0)
        coef = K * w - 1.0
        ok = np.isfinite(logw).any(1)
        return coef, {"round/log_ratio_mean": float(np.mean(log_a - log_pi)),
                      "round/log_ratio_clipped": float(np.mean(np.abs(log_a - log_pi) > clip)),
                      "round/ess_mean": float(np.mean(effective_sample_size(logw[ok]))) if ok.any() else None,
                      "round/kept_weight_max": float(np.mean(w[ok].max(1))) if ok.any() else None}
