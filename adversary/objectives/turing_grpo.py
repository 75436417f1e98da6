"""`objective: turing_grpo`: the published recipe against a learned judge (Turing-RL, GAD), on TRL's GRPOTrainer.

What it adds to `grpo` is a contract on the rest of the config, checked before anything is loaded:
- the discriminator is the language-model judge (`disc_family: lmjudge`: the generator's base model with its own
  LoRA adapter and head, Bradley-Terry on same-context pairs), warmed up before the phase on the warm start's own
  turns for `disc_init_items` train contexts and co-trained during it (`d_every`, `d_steps`);
- the reward is the judge's pairwise log-odds of the own turn against the context's real turn, capped at 0
  (`disc_reward: pairwise`: no reward for "more human than the human");
- a length band around the real turn (`length_band` > 1, `w_length` > 0) and a small KL to the warm start (`beta`
  > 0: TRL's reference model is the warm start, the policy's starting point).
The phase's contexts (`train_contexts`) are cut from the train split after the warm start's and the judge's
(`adversary.stages.prepare_data`), so RL spends real turns the warm start never trained on. configs/turing.yaml is
the preset; the loop, the meter and the gate are `grpo`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adversary.objectives import register
from adversary.objectives.grpo import GRPO

if TYPE_CHECKING:
    from adversary.config import AdversaryConfig


def recipe_problems(cfg: AdversaryConfig, args) -> list[str]:
    """What in (cfg, GRPOConfig) breaks the recipe, each with its fix; empty when it holds."""
    out = []
    if cfg.disc_family != "lmjudge":
        out.append(f"disc_family is {cfg.disc_family!r}: set disc_family: lmjudge (the judge this recipe trains against)")
    if cfg.disc_weights[0] <= 0:
        out.append("disc_weights[0] is 0: the judge must be a member (disc_weights: [1.0, 0.0])")
    if cfg.disc_reward != "pairwise":
        out.append(f"disc_reward is {cfg.disc_reward!r}: set disc_reward: pairwise (the capped pairwise reward)")
    if not (cfg.length_band > 1 and cfg.w_length > 0):
        out.append("the length band is off: set length_band > 1 (e.g. 1.5) and w_length > 0")
    if not getattr(args, "beta", 0.0) > 0:
        out.append("beta is 0: set a small KL to the warm start (e.g. beta: 0.01)")
    return out


@register("turing_grpo")
class TuringGRPO(GRPO):
    @classmethod
    def check_config(cls, cfg: AdversaryConfig, args) -> None:
        from conversations.config import ConfigError

        problems = recipe_problems(cfg, args)
        if problems:
            raise ConfigError("objective turing_grpo: " + "; ".join(problems) + " (configs/turing.yaml has the recipe)")

    def __init__(self, phase):
        self.check_config(phase.cfg, phase.args)
        super().__init__(phase)
