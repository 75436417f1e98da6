"""`objective: resample_sft`: a distilled residual energy model (Deng et al. 2020): the discriminator reweights the
simulator, and SFT carries the reweighted samples into the weights.

Each round: `round_contexts` contexts, `resample_candidates` own samples each; one kept per context with probability
proportional to D/(1-D) = exp(log-odds) (self-normalised importance resampling, `adversary.guidance.choose`; a
sample cut by the token budget or empty is never kept); one epoch of SFT (the warm start's settings and `sft_loss`)
on the kept turns mixed with real turns of the same contexts (`resample_real_share`); the discriminator co-trained
on an unbiased sample per context against the real turns, so the next round resamples by a refitted D.
"""

from __future__ import annotations

import numpy as np

from adversary.objectives import register
from adversary.objectives.base import RoundsObjective
from conversations.schema import TurnRecord


@register("resample_sft")
class ResampleSFT(RoundsObjective):
    owns = ("round_contexts", "max_rounds", "eval_rounds", "resample_candidates", "resample_real_share")

    def train_round(self, k: int, step: int) -> dict:
        from adversary.guidance import choose, effective_sample_size
        from conversations.memory import release_memory

        ph, cfg = self.phase, self.phase.cfg
        contexts, samples, scores = self.sample_round(k, cfg.resample_candidates)
        usable = np.asarray([[bool(t.text) and not t.truncated for t in ts] for ts in samples])  # (n_ctx, K)
        z = np.where(usable, scores, -np.inf)
        rows = np.flatnonzero(usable.any(1))
        picked = choose(z[rows], "resample", np.random.default_rng([ph.args.seed, k]))
        kept = [TurnRecord(id=f"{contexts[i].id}@resampled", context=contexts[i].context,
                           user_turn=samples[i][j].text, is_last=samples[i][j].ended) for i, j in zip(rows, picked)]
        share = cfg.resample_real_share
        n_real = min(len(contexts), round(len(kept) * share / (1 - share))) if share < 1 else len(contexts)
        real = contexts[:n_real]
        steps, loss = self.sft(real + kept, ph.args.seed + k) if kept or real else (0, None)  # nothing usable: no step
        release_memory()
        fig = {"round/steps": steps, "round/sft_loss": loss, "round/kept": len(kept), "round/real": len(real),
               "round/score_mean": float(np.mean(scores)),
               "round/kept_score_mean": float(np.mean(z[rows, picked])) if len(rows) else None,
               "round/ess_mean": float(np.mean(effective_sample_size(z[rows]))) if len(rows) else None,
               **self.sampling_figures(samples)}
        fig.update(self.cotrain(contexts, samples, step + steps))
        return fig

    def sft(self, records: list[TurnRecord], seed: int) -> tuple[int, float | None]:
        """One epoch of TRL's SFTTrainer on `records`, on the phase's LoRA model in place: (steps, mean loss)."""
        import shutil

        from adversary.stages import warm_start_config
        from adversary.trainer_parts import TimeBudget
        from generator.model import pick_device, prepare_training
        from generator.sft import make_trainer, prepare_config

        ph, cfg = self.phase, self.phase.cfg
        out = ph.out / "sft-round"
        sft_args, config = warm_start_config(cfg, ph.args, out, -1, seed, lr_scheduler_type="constant",
                                             warmup_ratio=0.0)
        config.num_train_epochs, config.logging_steps = 1, 1
        device = pick_device()
        prepare_config(sft_args, config, device)
        prepare_training(ph.model, device, config.max_length)
        left = ph.seconds_left()
        trainer = make_trainer(sft_args, config, ph.model, ph.tokenizer, records,
                               callbacks=[TimeBudget(left)] if left else None)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        steps = int(trainer.state.global_step)
        ph.model = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)
        del trainer
        shutil.rmtree(out, ignore_errors=True)
        return steps, float(np.mean(losses)) if losses else None

    def summary(self, fig: dict) -> str:
        loss = f"{fig['round/sft_loss']:.3f}" if fig.get("round/sft_loss") is not None else "-"
        ess = f", ESS {fig['round/ess_mean']:.2f} of {self.phase.cfg.resample_candidates}" \
            if fig.get("round/ess_mean") is not None else ""
        return (f"{fig['round/kept']} resampled + {fig['round/real']} real turns, {fig['round/steps']} SFT steps "
                f"(loss {loss}){ess}, discriminator acc on fresh {fig['disc/acc']:.3f}")
