"""`objective: dpo_rounds`: rounds of DPO whose pairs the discriminator picks (DIAL's form; adversary/rounds.py).

One round: `round_contexts` contexts, `round_samples` turns sampled for each by the current policy at the
simulator's sampling settings (`sim_temperature`, the meter's and the export's); every turn scored by the
discriminator; pairs by `build_pairs` (`round_chosen`: the best sample, or the real turn); one epoch of DPO; the
discriminator co-trained on one sample per context.
"""

from __future__ import annotations

import numpy as np

from adversary.objectives import register
from adversary.objectives.base import RoundsObjective


@register("dpo_rounds")
class DPORounds(RoundsObjective):
    owns = ("round_contexts", "max_rounds", "eval_rounds", "round_samples", "round_min_margin", "dpo_beta",
            "dpo_lr", "dpo_sft_weight", "dpo_batch_size", "dpo_micro_batch", "dpo_checkpointing", "dpo_loss",
            "round_chosen")

    def epochs(self) -> int:
        return 1

    def pairs(self, k: int, contexts, samples, scores) -> tuple[list[dict], dict]:
        from adversary.rounds import build_pairs

        return build_pairs(self.phase.cfg, contexts, samples, scores)

    def train_round(self, k: int, step: int) -> dict:
        from adversary.rounds import train_round
        from conversations.memory import release_memory

        ph, cfg = self.phase, self.phase.cfg
        contexts, samples, scores = self.sample_round(k, cfg.round_samples)
        rows, fig = self.pairs(k, contexts, samples, scores)
        steps, history = 0, []
        if rows:
            ph.model, history, steps = train_round(cfg, ph.args, ph.model, ph.tokenizer, rows, ph.out / "dpo-round",
                                                   ph.seconds_left(), epochs=self.epochs())
            release_memory()  # the trainer's freed activations, before the co-training and the meter land on them
        fig.update({**dpo_figures(history), **self.sampling_figures(samples), "round/steps": steps,
                    "round/dpo_steps": steps})
        fig.update(self.cotrain(contexts, samples, step + steps))
        return fig

    def summary(self, fig: dict) -> str:
        loss = f"{fig['round/dpo_loss']:.3f}" if fig.get("round/dpo_loss") is not None else "-"
        margin = f", reward margin {fig['round/dpo_margin']:+.3f}" if fig.get("round/dpo_margin") is not None else ""
        return (f"{fig['round/pairs']} pairs, {fig['round/steps']} DPO steps (loss {loss}{margin}), discriminator acc "
                f"on fresh {fig['disc/acc']:.3f}")


def dpo_figures(history: list[dict]) -> dict:
    """The round's DPO log means: the loss, and TRL's rewards/chosen, rewards/rejected and margin (a loss that stays
    at log 2 with a margin at 0 means the pairs taught nothing)."""

    def mean(key):
        vals = [h[key] for h in history if key in h]
        return float(np.mean(vals)) if vals else None

    return {"round/dpo_loss": mean("loss"),
            "round/dpo_chosen": mean("rewards/chosen"), "round/dpo_rejected": mean("rewards/rejected"),
            "round/dpo_margin": mean("rewards/margins")}
