"""What the phase's trainers share, below the phase loop (adversary.loop) and the DPO rounds (adversary.rounds)
that both use it: the wall-time budget callback and the save of the policy as it is now."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from transformers import TrainerCallback


class TimeBudget(TrainerCallback):
    """Stops training once `seconds` of wall time have passed since `start` (the study's equal-time arms)."""

    def __init__(self, seconds: float, start: float | None = None):
        self.seconds, self.start = seconds, start

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = self.start or time.time()
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.seconds and time.time() - self.start >= self.seconds:
            control.should_training_stop = True
        return control


class Snapshots(TrainerCallback):
    """Saves the model (its adapter under LoRA) to OUT/reading-j at the first step that ends after each of
    `seconds` (wall time since `start`), and lists what it saved in `readings` (the study's readings along an arm)."""

    def __init__(self, seconds: list[float], start: float, out: Path):
        self.seconds, self.start, self.out, self.readings = list(seconds), start, Path(out), []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        elapsed = time.time() - self.start
        while len(self.readings) < len(self.seconds) and elapsed >= self.seconds[len(self.readings)]:
            j = len(self.readings)
            d = self.out / f"reading-{j}"
            model.save_pretrained(str(d))
            self.readings.append({"reading": j, "at_seconds": self.seconds[j], "seconds": round(elapsed, 1),
                                  "step": int(state.global_step), "model_dir": str(d)})
        return control


def save_policy(trainer, out: Path) -> None:
    """Save the generator as it is now (adapter only under LoRA) into `out`, replacing what was there; collective
    under DeepSpeed/FSDP (every rank calls it)."""
    tmp = out.with_name(out.name + ".tmp")
    if trainer.accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()
    trainer.save_model(str(tmp))
    if trainer.accelerator.is_main_process:
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    trainer.accelerator.wait_for_everyone()
