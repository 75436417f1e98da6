"""`LMJudge`: a language-model judge of user turns, trained on same-context (real, simulated) pairs.

A causal LM reads the context tail and one candidate user turn and gives a scalar f(context, turn): how human the
turn is, as log-odds of "real". By default the backbone is the generator's base model (SmolLM2-135M-Instruct) with
its own LoRA adapter (every linear layer) and a new scalar head pooled at the last token: the judge knows what the
simulator's own model finds likely, which a 22M sentence encoder does not.

Training (the published recipes: GAD's Bradley-Terry discriminator, Turing-RL's pairwise judge):
- items that share a context with an item of the other label form pairs, and each pair contributes the
  Bradley-Terry loss -log sigmoid(f(real) - f(sim)): the judge learns which of two turns for the SAME context a
  person wrote, so it cannot lean on what the context alone says;
- an item without a partner contributes the pointwise log-loss of f against its label;
- label smoothing, where set, applies to both (a pair's target is 1 - eps/2).
Batches are built from whole context groups, so a pair is never split across an update. After a fit, the usual
`calibrate` moves the offset so that f reads as calibrated log-odds (a pairwise loss leaves the offset free).

`pair_log_odds(real, sim)` gives f(real) - f(sim) per pair: the judge's pairwise verdict, the reward of
`objective: turing_grpo` and the meter's paired accuracy both read it. Everything else (scoring, state, save/load,
freeze, precision) is `discriminator.neural.NeuralDetector`'s.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from conversations import DataError, TurnRecord
from discriminator.neural import NeuralDetector, NeuralDetectorConfig

JUDGE_LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}


@dataclass
class LMJudgeConfig(NeuralDetectorConfig):
    """The language-model judge's settings: `NeuralDetectorConfig`'s fields with a judge's defaults."""

    backbone: str = "smollm2-135m-instruct"  # by default the generator's base model, with its own adapter and head
    max_length: int = 160  # context tail + turn (99% of real turns fit in 81 tokens)
    context_tokens: int = 64
    lr: float = 2e-4  # LoRA moves slowly at an encoder's 2e-5
    head_lr: float | None = 1e-3
    batch_size: int = 16
    epochs: int = 1
    lora: bool | dict = field(default_factory=lambda: dict(JUDGE_LORA))
    weight_decay: float = 0.0

    def __post_init__(self):
        # False: a full fine-tune (a second copy of every weight's gradients and moments); True: the judge's LoRA
        if self.lora:
            self.lora = {**JUDGE_LORA, **self.lora} if isinstance(self.lora, dict) else dict(JUDGE_LORA)
        super().__post_init__()


def context_units(items: Sequence[TurnRecord], labels: np.ndarray) -> list[list[int]]:
    """Item indices grouped by context, in first-seen order: a group with both labels yields pairs; every other item
    is a group of its own. Empty contexts never group (they are not one context)."""
    from discriminator.features import has_context

    by_ctx: dict[str, list[int]] = defaultdict(list)
    units: list[list[int]] = []
    for i, it in enumerate(items):
        if has_context(it):
            key = it.context_key
            if key not in by_ctx:
                units.append(by_ctx[key])
            by_ctx[key].append(i)
        else:
            units.append([i])
    out = []
    for u in units:
        if len(set(labels[u].tolist())) == 2:
            out.append(u)
        else:
            out.extend([i] for i in u)
    return out


def pair_terms(unit: Sequence[int], labels: np.ndarray) -> tuple[list[tuple[int, int]], list[int]]:
    """(pairs (real, sim) as positions in `unit`, positions scored pointwise) for one context group."""
    y = labels[list(unit)]
    real = [k for k in range(len(unit)) if y[k] == 1]
    sim = [k for k in range(len(unit)) if y[k] == 0]
    if real and sim:
        return [(r, s) for r in real for s in sim], []
    return [], list(range(len(unit)))


class LMJudge(NeuralDetector):
    name = "lmjudge"
    config_class = LMJudgeConfig

    def _batches(self, units: list[list[int]], limit: int) -> list[list[list[int]]]:
        """Whole units packed in order into batches of at most `limit` items (a larger unit goes alone)."""
        out, cur, n = [], [], 0
        for u in units:
            if cur and n + len(u) > limit:
                out.append(cur)
                cur, n = [], 0
            cur.append(u)
            n += len(u)
        if cur:
            out.append(cur)
        return out

    def _accumulate(self, items: list[TurnRecord], y: np.ndarray) -> float:
        """Bradley-Terry on the same-context pairs of this batch, pointwise log-loss on the rest, averaged over the
        terms; micro-batches of whole context groups (`update` around it is NeuralDetector's)."""
        units = context_units(items, y)
        n_terms = sum(len(p) + len(q) for p, q in (pair_terms(u, y) for u in units))
        eps = self.cfg.label_smoothing
        total = 0.0
        for mb in self._batches(units, self.cfg.batch_size):
            flat = [i for u in mb for i in u]
            logits = self._logits(self._collate(self.encode([items[i] for i in flat])))  # (b,)
            diffs, targets, base = [], [], 0
            for u in mb:
                pairs, point = pair_terms(u, y)
                diffs += [logits[base + r] - logits[base + s] for r, s in pairs]
                targets += [1.0] * len(pairs)
                diffs += [logits[base + k] for k in point]
                targets += [float(y[u[k]]) for k in point]
                base += len(u)
            d = torch.stack(diffs)  # (terms,)
            t = torch.tensor(targets, device=d.device) * (1.0 - eps) + 0.5 * eps
            loss = F.binary_cross_entropy_with_logits(d, t, reduction="sum") / n_terms
            loss.backward()
            total += float(loss.detach())
        return total

    def _epoch_batches(self, items: Sequence[TurnRecord], y: np.ndarray) -> list[list[int]]:
        """One epoch's batches: the context groups in a seeded order, packed whole into about `batch_size` items, so
        a pair is never split across an update."""
        units = context_units(items, y)
        order = np.random.default_rng([self.cfg.seed, self.epochs_done]).permutation(len(units))
        return [[i for u in batch for i in u] for batch in self._batches([units[i] for i in order], self.cfg.batch_size)]

    def pair_log_odds(self, real: Sequence[TurnRecord], sim: Sequence[TurnRecord]) -> np.ndarray:
        """f(real_i) - f(sim_i) per pair [n]: > 0 where the judge picks the real turn as the human one."""
        if len(real) != len(sim):
            raise DataError(f"pair_log_odds needs as many real as simulated turns, got {len(real)} and {len(sim)}")
        s = self.score([*real, *sim])
        return s[:len(real)] - s[len(real):]

