"""`objective: spin`: self-play fine-tuning (SPIN, Chen et al. 2024) with the discriminator choosing the opponent.

Each iteration: `round_contexts` contexts, `round_samples` own samples each; the pair is (the real turn, the sample
the discriminator finds most detectable); the iteration trains `spin_epochs` epochs of DPO (`dpo_loss`,
`dpo_beta`, `dpo_sft_weight`) on its own pairs and on the earlier iterations' (`spin_history`; 0 keeps all); the
reference is the previous iterate (the policy at the iteration's start: TRL's copy of the adapter). Real text is
always the positive: the design the literature found to work where text GANs did not (shared/notes/anchors.md).
"""

from __future__ import annotations

import copy

from adversary.objectives import register
from adversary.objectives.dpo_rounds import DPORounds


@register("spin")
class Spin(DPORounds):
    owns = ("round_contexts", "max_rounds", "eval_rounds", "round_samples", "round_min_margin", "dpo_beta",
            "dpo_lr", "dpo_sft_weight", "dpo_batch_size", "dpo_micro_batch", "dpo_checkpointing", "dpo_loss",
            "spin_epochs", "spin_history")

    def __init__(self, phase):
        super().__init__(phase)
        self.history: list[list[dict]] = []  # each iteration's pairs, oldest first

    def epochs(self) -> int:
        return self.phase.cfg.spin_epochs

    def pairs(self, k: int, contexts, samples, scores) -> tuple[list[dict], dict]:
        from adversary.rounds import build_pairs

        cfg = copy.copy(self.phase.cfg)
        cfg.round_chosen = "real"
        rows, fig = build_pairs(cfg, contexts, samples, scores)
        keep = self.phase.cfg.spin_history
        earlier = self.history[-keep:] if keep else self.history
        train = [r for it in earlier for r in it] + rows
        self.history.append(rows)
        fig.update({"round/pairs_new": len(rows), "round/pairs": len(train)})
        return train, fig

    def state_dict(self) -> dict:
        keep = self.phase.cfg.spin_history
        return {"history": self.history[-keep:] if keep else self.history}

    def load_state_dict(self, d: dict) -> None:
        self.history = list(d.get("history", []))
