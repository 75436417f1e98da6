"""`objective: grpo`: TRL's GRPOTrainer, reward = the discriminator's verdict plus the realism terms
(`adversary.reward`), the discriminator co-trained from a callback (adversary/loop.py builds the trainer). TRL owns
the loop; the phase's readings come from `HeldoutGateCallback` every `eval_steps`. Runs under several processes."""

from __future__ import annotations

from adversary.objectives import register
from adversary.objectives.base import Objective, PhaseResult


@register("grpo")
class GRPO(Objective):
    owns = ("w_disc", "w_length", "length_band", "w_copy", "w_assistant", "reward_clip", "disc_reward", "grpo_rollout", "d_every",
            "num_generations", "max_completion_length", "temperature", "top_p", "top_k", "beta", "learning_rate",
            "per_device_train_batch_size", "gradient_accumulation_steps", "mask_truncated_completions",
            "eval_steps", "save_steps", "loss_type", "epsilon", "scale_rewards", "num_iterations")

    trainer = None

    def run(self) -> PhaseResult:
        from accelerate import PartialState

        from adversary.loop import build_trainer

        ph, ps = self.phase, PartialState()
        if ph.resume is not None:
            ph.state.load(ph.resume)
            ps.print(f"resuming from {ph.resume} (step {ph.state.step}, {len(ph.state.rows)} evaluations)")
        self.trainer = build_trainer(ph.cfg, ph.args, ph.model, ph.tokenizer, ph.state, ph.data, phase=ph,
                                     time_budget=ph.cfg.phase_seconds, time_start=ph.start_time)
        if ph.resume is not None and ph.state.gate.stopped:
            # the gate froze the generator before this checkpoint was written (or its step budget is spent): training
            # again would run one more step past the freeze
            ps.print(f"the gate already froze the generator ({ph.state.gate.reason}): exporting")
        else:
            self.trainer.train(resume_from_checkpoint=str(ph.resume) if ph.resume else None)
        model = self.trainer.accelerator.unwrap_model(self.trainer.model, keep_fp32_wrapper=False)
        return PhaseResult(model=model, steps=self.trainer.state.global_step, curve=self.curve())

    def curve(self) -> list[dict]:
        """Per logged step: the mean reward, the KL and the discriminator's latest co-training accuracy."""
        rounds = [(h["step"], h["disc/acc"]) for h in self.phase.state.cotrain_history]

        def disc_acc(step):
            before = [a for s, a in rounds if s <= step and a == a]
            return before[-1] if before else None

        return [{"step": h["step"], "reward": h.get("reward"), "disc_acc": disc_acc(h["step"]), "kl": h.get("kl")}
                for h in self.trainer.state.log_history if "reward" in h]

    def generation(self):
        from generator.engine import policy_model

        return policy_model(self.trainer, precision=self.phase.cfg.dtype, merge_lora=self.phase.cfg.heldout_merge_lora,
                            gather_zero3=self.phase.args.ds3_gather_for_generation)

    def save_best(self, directory) -> None:
        from adversary.trainer_parts import save_policy

        save_policy(self.trainer, directory)  # every rank: collective under DeepSpeed/FSDP
