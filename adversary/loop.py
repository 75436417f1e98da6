"""The adversarial phase on TRL: `GRPOTrainer` with the discriminator reward and realism terms, plus our callbacks
for co-training (`adversary.cotrain`), held-out td and the gate, numerical faults, and run-state checkpoints."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from adversary.cotrain import CoTrainCallback, FaultCounter, ReplayBuffer
from adversary.curves import plot_curves, write_curves
from adversary.gate import PlateauGate, Reading
from adversary.heldout import measure_heldout, simulate_heldout
from generator.engine import inference_model
from adversary.reward import build_rewards
from adversary.state import save_state

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
    """Held-out td before the first adversarial step and every `eval_steps`; the gate decides when to stop and which
    checkpoint is best (saved to OUTPUT_DIR/best)."""

    def __init__(self, cfg, args, data, tokenizer, gate: PlateauGate, rows: list, cotrain: CoTrainCallback):
        self.cfg, self.args, self.data, self.tok = cfg, args, data, tokenizer
        self.gate, self.rows, self.cotrain = gate, rows, cotrain
        self.trainer = None  # set after the trainer is built
        self.meter_seconds = 0.0
        self.out = Path(args.output_dir)

    # ---- one evaluation: simulate on every rank, measure on the main process, share the decision
    def evaluate(self, step: int) -> None:
        from accelerate.utils import broadcast_object_list

        acc = self.trainer.accelerator
        t0 = time.perf_counter()
        with inference_model(self.trainer.model_wrapped, acc, precision=self.cfg.dtype,
                             merge_lora=self.cfg.heldout_merge_lora, gather_zero3=self.args.ds3_gather_for_generation) as gen:
            sims = simulate_heldout(gen, self.tok, self.data.heldout, self.cfg, acc, precision=self.cfg.dtype)
        payload = [None]
        if acc.is_main_process:
            row = {"step": step, **measure_heldout(self.data.heldout, sims, self.cfg)}
            row["disc/acc"] = self.cotrain.last.get("disc/acc")
            hist = self.trainer.state.log_history
            rewards = [h["reward"] for h in hist if "reward" in h]
            kls = [h["kl"] for h in hist if "kl" in h]
            row["gen/reward"] = rewards[-1] if rewards else None
            row["gen/kl"] = kls[-1] if kls else None
            decision = self.gate.update(Reading(step, row["td/panel"], row["td/ci_low"], row["td/ci_high"]))
            row["td/eval_seconds"] = time.perf_counter() - t0
            self.rows.append(row)
            payload = [{"row": row, "stop": decision.stop, "is_best": decision.is_best, "gate": self.gate.state_dict()}]
        broadcast_object_list(payload, from_process=0)
        res = payload[0]
        if not acc.is_main_process:  # keep the gate identical everywhere
            self.gate = PlateauGate.from_state_dict(res["gate"])
            self.rows.append(res["row"])
        if res["is_best"]:
            from adversary.stages import save_policy

            save_policy(self.trainer, self.out / "best")
            if acc.is_main_process:
                (self.out / "best" / "best.json").write_text(json.dumps(res["row"], default=str, indent=2))
        self.meter_seconds += time.perf_counter() - t0
        if acc.is_main_process:
            self.write_outputs()
            r = res["row"]
            acc = r.get("disc/acc")
            print(f"[td] step {step}: td {r['td/panel']:.1f} (95% CI {r['td/ci_low']:.1f}-{r['td/ci_high']:.1f}), "
                  f"auc {r['td/auc']:.3f}, disc acc {acc if acc is None else round(acc, 3)}"
                  f"{'  best' if res['is_best'] else ''}{'  -> gate: ' + self.gate.describe() if res['stop'] else ''}")
        # every rank logs: Trainer.log runs collectives, and a main-only call would put the ranks out of step
        self.trainer.log(curve_metrics(res["row"]))
        self._stop = res["stop"]

    def write_outputs(self) -> None:
        write_curves(self.rows, self.out / "curves.csv")
        freeze = self.rows[-1]["step"] if self.gate.stopped else None
        plot_curves(self.rows, self.out / "turing_curve.png", freeze_step=freeze,
                    best_step=self.gate.best.step if self.gate.best else None)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not self.rows or self.rows[-1]["step"] < state.global_step:
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
        if self.rows and self.rows[-1]["step"] < state.global_step and not self.gate.stopped:
            self.evaluate(state.global_step)
        self.gate.finish(state.global_step)
        if self.trainer.accelerator.is_main_process:
            self.write_outputs()
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
    """Adds the discriminator, replay buffer, gate, curve rows, co-training history and faults to every checkpoint."""

    def __init__(self, disc, buffer, heldout_cb: HeldoutGateCallback, cotrain: CoTrainCallback, faults: FaultCounter, accelerator):
        self.disc, self.buffer, self.heldout, self.cotrain, self.faults = disc, buffer, heldout_cb, cotrain, faults
        self.accelerator = accelerator

    def on_save(self, args, state, control, **kwargs):
        if self.accelerator.is_main_process:
            ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            save_state(ckpt, discriminator=self.disc, parts={
                "buffer": self.buffer.state_dict(),
                "gate": self.heldout.gate.state_dict(),
                "rows": self.heldout.rows,
                "cotrain": self.cotrain.state_dict(),
                "faults": self.faults.counts,
                "meter_seconds": self.heldout.meter_seconds,
            })
        self.accelerator.wait_for_everyone()
        return control


def grpo_dataset(cfg, tokenizer, records, seed: int):
    """Prompts for GRPO: the role-flipped simulator prompt (rendered, left-truncated to the token budget) and, as
    extra columns the reward functions receive, the context, the real turn of that context and the record id."""
    from datasets import Dataset

    from generator.data import sample_records
    from generator.prompts import render_prompt

    chosen = sample_records(records, cfg.train_contexts, seed=seed + 3)
    return Dataset.from_list([
        {
            "prompt": render_prompt(tokenizer, r.context, max_context_tokens=cfg.max_context_tokens),
            "context": json.dumps(r.context, ensure_ascii=False),
            "real_turn": r.user_turn,
            "record_id": r.id,
        }
        for r in chosen
    ])


def build_trainer(cfg, args, model, tokenizer, disc, data, *, gate, rows, buffer: ReplayBuffer, faults: FaultCounter,
                  heldout: bool = True):
    """The GRPO trainer with our callbacks. `heldout=False` (the study) leaves out the held-out td, gate and run-state
    callbacks: the generator then trains for exactly `max_steps`."""
    from peft import LoraConfig
    from trl import GRPOTrainer

    reward_funcs, weights = build_rewards(cfg, disc, buffer, faults)
    args.reward_weights = weights
    peft_config = None
    if cfg.lora_r > 0:
        peft_config = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                                 target_modules="all-linear", task_type="CAUSAL_LM")
    from accelerate import PartialState

    accelerator_state = PartialState()

    class _Acc:  # the callbacks need rank facts before the trainer (and its accelerator) exists
        num_processes = accelerator_state.num_processes
        is_main_process = accelerator_state.is_main_process
        process_index = accelerator_state.process_index

    cotrain = CoTrainCallback(cfg, disc, buffer, _Acc)
    heldout_cb = HeldoutGateCallback(cfg, args, data, tokenizer, gate, rows, cotrain)
    runstate = RunStateCallback(disc, buffer, heldout_cb, cotrain, faults, _Acc)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=grpo_dataset(cfg, tokenizer, data.train, args.seed),
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[FaultGuard(faults), cotrain] + ([heldout_cb, runstate] if heldout else []),
    )
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(QuietProgress())
    # FaultGuard and the co-training callback add their metrics (faults/*, disc/*) to `logs` in on_log: they must run
    # before the reporting integrations (TensorBoard, trackio, wandb) read it, and those are registered first
    handler = trainer.callback_handler
    ours = [c for c in handler.callbacks if isinstance(c, (FaultGuard, CoTrainCallback))]
    handler.callbacks = ours + [c for c in handler.callbacks if c not in ours]
    heldout_cb.trainer = trainer
    cotrain.accelerator = trainer.accelerator
    runstate.accelerator = trainer.accelerator
    return trainer, heldout_cb, cotrain
