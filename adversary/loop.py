"""The adversarial phase on TRL: `GRPOTrainer` with the discriminator reward and realism terms, plus our callbacks
for co-training (`adversary.cotrain`), held-out td and the gate, numerical faults, and run-state checkpoints."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import TrainerCallback

from adversary.cotrain import CoTrainCallback, FaultCounter
from adversary.reward import build_rewards
from adversary.trainer_parts import TimeBudget
from conversations.assets import before_another_trainer

if TYPE_CHECKING:
    from adversary.config import AdversaryConfig, DataArgs

log = logging.getLogger("adversary")


class FaultGuard(TrainerCallback):
    """A step whose gradients are not finite is skipped (grads dropped before the optimiser sees them) and counted;
    non-finite losses and rewards are counted; past `max_faults` the run stops with a clear message."""

    def __init__(self, faults: FaultCounter):
        self.faults = faults

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        params = [p for p in model.parameters() if p.grad is not None]
        if params and not all(torch.isfinite(p.grad).all() for p in params):
            for p in params:
                p.grad = None  # AdamW skips parameters without a gradient: the step is skipped
            self.faults.add("grad")
            log.warning("step %d: non-finite gradient, step skipped (%d faults)", state.global_step, self.faults.total)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs and not math.isfinite(logs["loss"]):
            self.faults.add("loss")
        if self.faults.exceeded():
            control.should_training_stop = True
        return control


class HeldoutGateCallback(TrainerCallback):
    """GRPO's held-out readings, through the phase loop (`adversary.objectives.base.Phase`, which owns the meter,
    the gate and the best checkpoint): before the first adversarial step and every `eval_steps`, the latest reward,
    KL and co-training accuracy beside each reading."""

    def __init__(self, phase):
        self.phase = phase
        self.trainer = None  # set after the trainer is built
        self._stop = False

    def evaluate(self, step: int) -> None:
        hist = self.trainer.state.log_history
        rewards = [h["reward"] for h in hist if "reward" in h]
        kls = [h["kl"] for h in hist if "kl" in h]
        extra = {"gen/reward": rewards[-1] if rewards else None, "gen/kl": kls[-1] if kls else None}
        self._stop = self.phase.evaluate(step, extra, self.trainer.accelerator)
        # every rank logs: Trainer.log runs collectives, and a main-only call would put the ranks out of step
        self.trainer.log(curve_metrics(self.phase.state.rows[-1]))

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        rows = self.phase.state.rows
        if not rows or rows[-1]["step"] < state.global_step:
            self.evaluate(state.global_step)
            if self._stop:
                control.should_training_stop = True
        return control

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % args.eval_steps == 0:
            self.evaluate(state.global_step)
            if self._stop:
                control.should_training_stop = True
        return control

    def on_train_end(self, args, state, control, model=None, **kwargs):
        rows = self.phase.state.rows
        if rows and rows[-1]["step"] < state.global_step and not self.phase.state.gate.stopped:
            self.evaluate(state.global_step)
        self.phase.finish(state.global_step, accelerator=self.trainer.accelerator)
        return control


def curve_metrics(row: dict) -> dict:
    """The numbers of a curve row, for the loggers; the row's keys already are the metric names (td/panel,
    td/ci_low, td/<detector>, diag/..., disc/acc at the evaluation is logged as disc/acc_at_eval so that it does not
    overwrite the co-training's own per-round disc/acc)."""
    out = {}
    for k, v in row.items():
        if k == "step" or not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        out["disc/acc_at_eval" if k == "disc/acc" else k] = v
    return out


class QuietProgress(TrainerCallback):
    """One progress bar over generator steps, with the latest td and reward beside it; no per-step dict dumps."""

    def __init__(self):
        self.bar = None
        self.postfix = {}

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="adversarial", dynamic_ncols=True)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.bar is not None and logs:
            for key, short in (("reward", "reward"), ("td/panel", "td"), ("disc/acc", "disc_acc"), ("kl", "kl")):
                if isinstance(logs.get(key), (int, float)):
                    self.postfix[short] = round(float(logs[key]), 3)
            self.bar.set_postfix(self.postfix, refresh=False)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        return control


class RunStateCallback(TrainerCallback):
    """Adds the run state (`AdversaryState`: discriminator, replay buffer, gate, curve rows, co-training history,
    faults) to every checkpoint the trainer writes."""

    def __init__(self, state):
        self.state = state
        self.accelerator = None  # set once the trainer exists

    def on_save(self, args, state, control, **kwargs):
        if self.accelerator.is_main_process:
            self.state.save(Path(args.output_dir) / f"checkpoint-{state.global_step}")
        self.accelerator.wait_for_everyone()
        return control


def grpo_dataset(cfg: DataArgs, tokenizer, records):
    """Prompts for GRPO: the role-flipped simulator prompt (rendered, left-truncated to the token budget) and, as
    extra columns the reward functions receive, the context, the real turn of that context and the record id.
    `records`: the run's GRPO contexts (drawn in `prepare_data`)."""
    from datasets import Dataset

    from generator.prompts import render_prompt

    return Dataset.from_list([
        {
            "prompt": render_prompt(tokenizer, r.context, max_context_tokens=cfg.max_context_tokens),
            "context": json.dumps(r.context, ensure_ascii=False),
            "real_turn": r.user_turn,
            "record_id": r.id,
        }
        for r in records
    ])


def grpo_trainer(cfg: AdversaryConfig, args, model, tokenizer, train_dataset, reward_funcs, callbacks=None, *,
                 prepare: bool = True):
    """TRL's GRPOTrainer as this project runs it: the model prepared for training on its device
    (`generator.model.prepare_training`), LoRA from the config and, with `grpo_rollout: engine` (not under vLLM),
    the group's completions sampled by `adversary.rollout.EngineRollout`. `prepare=False` leaves the model and the
    rollouts as TRL has them (the benchmark's baseline)."""
    import os

    from trl import GRPOTrainer

    from adversary.rollout import EngineRollout
    from generator.model import pick_device, prepare_training

    rollout = None
    if prepare:
        prepare_training(model, pick_device(), cfg.max_context_tokens + args.max_completion_length)
        # under FSDP every rank must run the same forwards as the others (TRL's `generate` syncs them); the engine
        # stops a rank as soon as its rows are done, so FSDP keeps TRL's generation
        fsdp = bool(args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        if cfg.grpo_rollout == "engine" and not args.use_vllm and not fsdp:
            os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental
            rollout = EngineRollout(tokenizer, EngineRollout.settings_from(args), precision=cfg.dtype,
                                    batch_size=cfg.sim_batch_size, seed=args.seed, merge_lora=cfg.heldout_merge_lora)
    before_another_trainer()
    trainer = GRPOTrainer(model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                          processing_class=tokenizer, peft_config=cfg.peft_config(),
                          callbacks=callbacks, rollout_func=rollout)
    if rollout is not None:
        rollout.widen_stops(trainer)
    return trainer


def build_trainer(cfg: AdversaryConfig, args, model, tokenizer, state, data, *, phase=None, time_budget: float = 0.0,
                  time_start: float | None = None):
    """The GRPO trainer with our callbacks. Without a `phase` that has a meter (the study) the held-out td, gate and
    run-state callbacks are left out: the generator then trains for exactly `max_steps` (or `time_budget` seconds
    from `time_start`)."""
    reward_funcs, weights = build_rewards(cfg, state)
    args.reward_weights = weights
    cotrain = CoTrainCallback(cfg, state)
    callbacks = [FaultGuard(state.faults), cotrain]
    heldout_cb = runstate = None
    if phase is not None and phase.meter is not None:
        heldout_cb, runstate = HeldoutGateCallback(phase), RunStateCallback(state)
        callbacks += [heldout_cb, runstate]
    if time_budget:
        callbacks.append(TimeBudget(time_budget, start=time_start))
    trainer = grpo_trainer(cfg, args, model, tokenizer, grpo_dataset(cfg, tokenizer, data.grpo), reward_funcs, callbacks)
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(QuietProgress())
    # FaultGuard and the co-training callback add their metrics (faults/*, disc/*) to `logs` in on_log: they must run
    # before the reporting integrations (TensorBoard, trackio, wandb) read it, and those are registered first
    handler = trainer.callback_handler
    ours = [c for c in handler.callbacks if isinstance(c, (FaultGuard, CoTrainCallback))]
    handler.callbacks = ours + [c for c in handler.callbacks if c not in ours]
    cotrain.accelerator = trainer.accelerator
    if heldout_cb is not None:
        heldout_cb.trainer = trainer
        runstate.accelerator = trainer.accelerator
    return trainer
