"""Rewards of a simulated user turn, as TRL reward functions (one callable per term, so TRL logs each on its own
under `rewards/<name>/mean`; their weights go to `GRPOConfig.reward_weights`).

- `disc`: from the co-trained discriminator's log-odds z that the turn is real: `disc_reward: logit` gives
  clip(z, -clip, clip); `log_d` (the non-saturating GAN reward) gives log sigmoid(z), clipped below at -clip: no
  reward for "more real than real", and a turn the discriminator is sure about still gets a gradient;
  `pairwise` (Turing-RL's reward, for a judge of same-context pairs) gives min(0, z(own) - z(real)) with z(real) the
  judge's log-odds of the context's real turn: 0 is "cannot tell", nothing for "more human than the human", clipped
  below at -clip;
- `length`: -|log(len_sim / len_real)| against the real turn of the same context (capped at 3); with a band b > 1,
  no penalty inside [len_real / b, len_real x b] and -(|log ratio| - log b) outside;
- `copy`: minus the share of the turn copied from the context (long n-gram overlap);
- `assistant`: minus the assistant-likeness of the turn ("I'd be happy to help", "As an AI", bullet lists).

Every scored triple (context, simulated, real) also goes to the replay buffer that the discriminator trains on.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from conversations.schema import TurnRecord
from generator.diagnostics import assistant_likeness_score, copy_score
from generator.prompts import strip_end_marker

if TYPE_CHECKING:
    from adversary.config import AdversaryConfig


def completion_text(c: Any) -> str:
    """TRL passes strings for plain prompts and [{"role": "assistant", "content": ...}] for conversational ones."""
    if isinstance(c, list):
        return c[-1]["content"] if c else ""
    return c


def simulated_records(completions, context, record_id) -> list[TurnRecord]:
    out = []
    for c, ctx, rid in zip(completions, context, record_id):
        text, _ = strip_end_marker(completion_text(c))
        out.append(TurnRecord(id=f"{rid}@sim", context=json.loads(ctx) if isinstance(ctx, str) else ctx, user_turn=text.strip()))
    return out


def disc_reward(logits: np.ndarray, kind: str, clip: float, real_logits: np.ndarray | None = None) -> np.ndarray:
    """The discriminator term from its log-odds of "real" (B,): `logit`, `log_d` or `pairwise` (which needs the
    log-odds of each context's real turn, `real_logits`) (see the module docstring)."""
    z = np.asarray(logits, dtype=np.float64)
    if kind == "pairwise":
        if real_logits is None:
            raise ValueError("the pairwise reward needs the real turns' log-odds")
        return np.clip(z - np.asarray(real_logits, dtype=np.float64), -clip, 0.0)
    if kind == "log_d":
        return np.maximum(-np.logaddexp(0.0, -z), -clip)  # log sigmoid(z), stable
    return np.clip(z, -clip, clip)


class DiscriminatorReward:
    """The discriminator term, scored in one batch by the current discriminator."""

    __name__ = "disc"

    def __init__(self, discriminator, buffer, clip: float = 5.0, faults=None, kind: str = "logit"):
        self.discriminator = discriminator
        self.buffer = buffer
        self.clip, self.kind = clip, kind
        self.faults = faults  # FaultCounter or None: non-finite scores are counted, then replaced by 0

    def __call__(self, prompts, completions, context, real_turn, record_id, log_metric=None, **kwargs):
        sims = simulated_records(completions, context, record_id)
        reals = []
        if self.kind == "pairwise":  # the same contexts' real turns, scored in the same call (identical ones once)
            reals = [TurnRecord(id=f"{rid}", context=s.context, user_turn=r) for s, r, rid in zip(sims, real_turn, record_id)]
        scores = np.asarray(self.discriminator.score([*sims, *reals]), dtype=np.float64)  # (B,) or (2B,)
        bad = ~np.isfinite(scores)
        if bad.any() and self.faults is not None:
            self.faults.add("reward", int(bad.sum()))
        scores = np.where(bad, 0.0, scores)
        logits, real_logits = scores[:len(sims)], (scores[len(sims):] if reals else None)
        self.buffer.add(sims, real_turn)
        if log_metric is not None:
            log_metric("disc/p_real_on_sim", float(np.mean(1 / (1 + np.exp(-logits)))))
            if real_logits is not None:
                log_metric("disc/pair_acc", float(np.mean(real_logits > logits)))
        return disc_reward(logits, self.kind, self.clip, real_logits).tolist()


def length_penalty(sim_chars: int, real_chars: int, band: float = 0.0) -> float:
    """-|log ratio| of the lengths (capped at 3); with a band b > 1, 0 inside [real / b, real x b]."""
    gap = abs(math.log((sim_chars + 1) / (real_chars + 1)))
    if band > 1.0:
        gap = max(0.0, gap - math.log(band))
    return -min(3.0, gap)


class LengthReward:
    __name__ = "length"

    def __init__(self, band: float = 0.0):
        self.band = band

    def __call__(self, prompts, completions, real_turn, **kwargs):
        return [length_penalty(len(strip_end_marker(completion_text(c))[0].strip()), len(real), self.band)
                for c, real in zip(completions, real_turn)]


class CopyReward:
    __name__ = "copy"

    def __call__(self, prompts, completions, context, **kwargs):
        return [
            -float(copy_score(strip_end_marker(completion_text(c))[0], json.loads(ctx) if isinstance(ctx, str) else ctx))
            for c, ctx in zip(completions, context)
        ]


class AssistantReward:
    __name__ = "assistant"

    def __call__(self, prompts, completions, **kwargs):
        return [-float(assistant_likeness_score(strip_end_marker(completion_text(c))[0])) for c in completions]


def build_rewards(cfg: AdversaryConfig, state) -> tuple[list, list[float]]:
    """The reward callables and their weights; terms with weight 0 are left out (nothing to compute)."""
    terms = [
        (DiscriminatorReward(state.discriminator, state.buffer, cfg.reward_clip, state.faults, cfg.disc_reward), cfg.w_disc),
        (LengthReward(cfg.length_band), cfg.w_length),
        (CopyReward(), cfg.w_copy),
        (AssistantReward(), cfg.w_assistant),
    ]
    # the discriminator term always runs: it feeds the replay buffer even at weight 0
    kept = [(f, w) for i, (f, w) in enumerate(terms) if w > 0 or i == 0]
    return [f for f, _ in kept], [float(w) for _, w in kept]
