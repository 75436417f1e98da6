"""The interface every objective implements, and the phase loop that owns what they share.

`Phase` is the adversarial phase's context and its one owner of the meter, the gate and the best checkpoint:
`phase.evaluate(step)` reads the held-out td with the objective's current generator, lets the gate decide and saves
the best checkpoint; `phase.finish(step)` takes the last reading if the newest steps were never read, closes the gate
and writes the curve files. Without a meter (the study's arms) both only keep time.

`Objective` is a whole phase (`run`): GRPO hands the loop to TRL's trainer and calls `phase.evaluate` from a
callback. `RoundsObjective` is the common case, one round at a time: subclasses write `train_round` (sample, score,
build their data, train, co-train the discriminator) and the loop here does the rest: LoRA set up or restored,
the budget, when to read td, a checkpoint after every round, resuming from the newest one.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from conversations.schema import DataError, TurnRecord
from conversations.seeds import seed_for


@dataclass
class PhaseResult:
    model: Any  # the trained generator (a PeftModel for the LoRA objectives)
    steps: int  # optimiser steps of the phase
    curve: list[dict]  # per round or per log: what the objective measured while it trained


@dataclass
class Phase:
    """Everything an objective works with. `meter` None: no held-out readings, no gate, no best checkpoint (the
    study's arms, which train for a fixed time). `start_time`: when the phase's time budget (`phase_seconds`) began."""

    cfg: Any
    args: Any  # TRL's GRPOConfig of the run: output_dir, seed, max_steps, the optimiser of the GRPO objective
    model: Any
    tokenizer: Any
    state: Any  # adversary.state.AdversaryState: discriminator, replay buffer, gate, curve rows
    data: Any  # adversary.stages.RunData
    meter: Any = None  # adversary.heldout.HeldoutMeter
    resume: Path | None = None
    start_time: float = field(default_factory=time.time)
    objective: Any = None  # set by Objective.__init__
    # seconds into the phase at which the generator is saved to OUT/reading-j (the study's readings along an arm),
    # each at the end of the first round that ends after it; what was saved is listed in `readings`
    snapshot_seconds: list[float] = field(default_factory=list)
    readings: list[dict] = field(default_factory=list)

    @property
    def out(self) -> Path:
        return Path(self.args.output_dir)

    def seconds_left(self) -> float | None:
        """Seconds left of `phase_seconds`, None without a time budget."""
        if not self.cfg.phase_seconds:
            return None
        return self.cfg.phase_seconds - (time.time() - self.start_time)

    def evaluate(self, step: int, extra: dict | None = None, accelerator=None) -> bool:
        """One held-out reading at `step` with the objective's generator; the best checkpoint saved to OUT/best.
        Returns whether the gate froze the generator."""
        if self.meter is None:
            return False
        extra = {"disc/acc": self.state.cotrain_history[-1]["disc/acc"] if self.state.cotrain_history else None,
                 **(extra or {})}
        row, stop, is_best = self.meter.evaluate(step, self.objective.generation(), accelerator, extra)
        if is_best:
            best = self.out / "best"
            self.objective.save_best(best)
            if accelerator is None or accelerator.is_main_process:
                (best / "best.json").write_text(json.dumps(row, default=str, indent=2))
        return stop

    def snapshot(self, step: int) -> None:
        """Save the generator to OUT/reading-j for every time in `snapshot_seconds` that has now passed."""
        elapsed = time.time() - self.start_time
        while len(self.readings) < len(self.snapshot_seconds) and elapsed >= self.snapshot_seconds[len(self.readings)]:
            j = len(self.readings)
            d = self.out / f"reading-{j}"
            self.objective.save_best(d)
            self.readings.append({"reading": j, "at_seconds": self.snapshot_seconds[j], "seconds": round(elapsed, 1),
                                  "step": step, "model_dir": str(d)})

    def finish(self, step: int, reason: str | None = None, accelerator=None) -> None:
        """The last reading when the newest steps were never read (and the gate has not frozen), the gate closed,
        the curve files written."""
        if self.meter is None:
            return
        if self.state.rows and self.state.rows[-1]["step"] < step and not self.state.gate.stopped:
            self.evaluate(step, accelerator=accelerator)
        self.state.gate.finish(step, *([reason] if reason else []))
        if accelerator is None or accelerator.is_main_process:
            self.meter.write_outputs()


class Objective:
    """A way for the generator to learn against the discriminator. Subclasses set `name` through `@register`."""

    name = "?"
    processes = "any"  # "one": refuses to run under several processes
    # the config keys only this objective (and its kin) reads: a key set for another objective and not read by the
    # chosen one is reported at the start of the run (`adversary.objectives.ignored_keys`)
    owns: tuple[str, ...] = ()

    def __init__(self, phase: Phase):
        self.phase = phase
        phase.objective = self
        if self.processes == "one":
            from accelerate import PartialState

            if PartialState().num_processes > 1:
                raise DataError(f"objective {self.name} runs in one process; use objective grpo to train on several")

    @classmethod
    def latest_checkpoint(cls, out_dir: Path) -> Path | None:
        """The newest complete checkpoint this objective wrote under `out_dir` (`--resume_from_checkpoint latest`)."""
        from adversary.state import latest_complete_checkpoint

        return latest_complete_checkpoint(out_dir)

    def generation(self):
        """A context manager yielding the model the meter simulates with (a merged inference copy by default)."""
        from generator.engine import policy_model

        return policy_model(self.phase.model, precision=self.phase.cfg.dtype)

    def save_best(self, directory: Path) -> None:
        shutil.rmtree(directory, ignore_errors=True)
        self.phase.model.save_pretrained(str(directory))

    def run(self) -> PhaseResult:
        raise NotImplementedError


ROUND_DIR = "round-{:04d}"


class RoundsObjective(Objective):
    """An objective that trains in rounds; subclasses write `train_round(k, step) -> dict` (its figures,
    with `round/steps`: optimiser steps taken) and may override `setup`. One process (the rounds sample, score and train
    on the main process's data)."""

    processes = "one"

    @classmethod
    def latest_checkpoint(cls, out_dir: Path) -> Path | None:
        from adversary.state import COMPLETE, STATE_DIR

        found = sorted(p for p in Path(out_dir).glob("round-*") if (p / STATE_DIR / COMPLETE).exists())
        return found[-1] if found else None

    # ---- what a subclass writes

    def train_round(self, k: int, step: int) -> dict:
        """Round k, starting at optimiser step `step`: its figures, with `round/steps` (optimiser steps taken)."""
        raise NotImplementedError

    def summary(self, fig: dict) -> str:
        """The round's line after `[round k]`."""
        return f"{fig['round/steps']} steps"

    def state_dict(self) -> dict:
        """What the objective itself must keep across a resume (saved in every round's folder)."""
        return {}

    def load_state_dict(self, d: dict) -> None:
        pass

    # ---- the loop

    def setup(self) -> int:
        """A LoRA adapter on the warm start, or the adapter and run state of `phase.resume`; returns the step."""
        from peft import PeftModel, get_peft_model

        ph = self.phase
        if ph.cfg.lora_r <= 0:
            raise DataError(f"objective {self.name} trains a LoRA adapter: set lora_r > 0")
        if ph.resume is None:
            ph.model = get_peft_model(ph.model, ph.cfg.peft_config())
            return 0
        print(f"resuming from {ph.resume}", flush=True)
        ph.model = PeftModel.from_pretrained(ph.model, str(ph.resume), is_trainable=True)
        ph.state.load(ph.resume)
        doc = json.loads((ph.resume / "round.json").read_text())
        self.load_state_dict(doc.get("objective", {}))
        return doc["step"]

    def run(self) -> PhaseResult:
        from conversations.memory import peak_rss_mb, release_memory

        ph, cfg, args = self.phase, self.phase.cfg, self.phase.args
        step = self.setup()
        figures: list[dict] = []
        stop = ph.evaluate(step) if ph.meter is not None and not ph.state.rows else False
        last_round, ended = 0.0, "max_steps"
        while not stop:
            k, left = ph.state.rounds_done, ph.seconds_left()
            # a time budget does not start a round it cannot get half through (sampling and scoring come first)
            ended = ("max_rounds" if cfg.max_rounds and k >= cfg.max_rounds else
                     "max_steps" if args.max_steps > 0 and step >= args.max_steps else
                     "phase_seconds" if left is not None and left <= max(0.0, 0.5 * last_round) else None)
            if ended:
                break
            t0 = time.time()
            fig = self.train_round(k, step)
            step += fig["round/steps"]
            ph.state.rounds_done = k + 1
            fig.update({"round": k, "step": step, "round/seconds": time.time() - t0, "round/peak_rss_mb": peak_rss_mb()})
            figures.append(fig)
            last_round = fig["round/seconds"]
            print(f"[round {k}] {self.summary(fig)}, {fig['round/seconds']:.0f}s, peak memory "
                  f"{fig['round/peak_rss_mb']} MB", flush=True)
            if (k + 1) % cfg.eval_rounds == 0 and (not ph.state.rows or step > ph.state.rows[-1]["step"]):
                stop = ph.evaluate(step)
            self.save_round(k, step)
            ph.snapshot(step)
            release_memory()
        ph.finish(step, ended or "max_steps")
        ph.out.mkdir(parents=True, exist_ok=True)  # a budget spent before the first round leaves no round folder
        (ph.out / "rounds.json").write_text(json.dumps(figures, indent=2, default=float))
        return PhaseResult(model=ph.model, steps=step, curve=figures)

    def save_round(self, k: int, step: int, keep: int = 2) -> Path:
        """OUTPUT_DIR/round-k: the adapter, the objective's own state and the run state, the state's COMPLETE marker
        written last; only the newest `keep` complete rounds stay (each holds the discriminator and its optimiser)."""
        from adversary.state import COMPLETE, STATE_DIR

        ph = self.phase
        d = ph.out / ROUND_DIR.format(k)
        ph.model.save_pretrained(str(d))
        (d / "round.json").write_text(json.dumps({"round": k, "step": step, "objective": self.state_dict()}))
        ph.state.save(d)
        done = sorted(p for p in ph.out.glob("round-*") if (p / STATE_DIR / COMPLETE).exists())
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        return d

    # ---- pieces most rounds share

    def sample_round(self, k: int, n_samples: int, temperature: float | None = None, top_p: float | None = None):
        """Round k's contexts and `n_samples` turns of the current policy for each, scored by the discriminator:
        (contexts, samples [n_ctx][n_samples] of SimulatedTurn, log-odds (n_ctx, n_samples)). `temperature` /
        `top_p`: other than the simulator's sampling settings (T 1 and top-p 1 draw from the policy itself, which
        importance weights against it need)."""
        from adversary.heldout import heldout_settings
        from adversary.rounds import round_contexts
        from conversations.memory import release_memory
        from generator.engine import policy_engine
        from generator.sample import user_turns

        ph, cfg = self.phase, self.phase.cfg
        contexts = round_contexts(ph.data, cfg, k, ph.args.seed)
        settings = heldout_settings(cfg, temperature).replace(top_p=top_p)
        many = [c for c in contexts for _ in range(n_samples)]
        with policy_engine(ph.model, ph.tokenizer, precision=cfg.dtype, batch_size=cfg.sim_batch_size) as engine:
            turns = user_turns(engine, [c.context for c in many], settings,
                               seed=seed_for("plateau_samples", ph.args.seed, k))
        release_memory()
        samples = [turns[i * n_samples:(i + 1) * n_samples] for i in range(len(contexts))]
        from adversary.discriminator import with_end

        sims = [TurnRecord(id=f"{c.id}@sim{j}", context=c.context,
                           user_turn=with_end(t.text or "...", t.ended, cfg.disc_sees_end))
                for c, ts in zip(contexts, samples) for j, t in enumerate(ts)]
        scores = np.asarray(ph.state.discriminator.score(sims)).reshape(len(contexts), n_samples)
        return contexts, samples, scores

    def real_scores(self, contexts) -> np.ndarray:
        """(n_ctx,) the discriminator's log-odds of each context's real turn, seen as its samples are."""
        from adversary.discriminator import with_end

        on = self.phase.cfg.disc_sees_end
        items = [TurnRecord(id=f"{c.id}@real", context=c.context, user_turn=with_end(c.user_turn, c.is_last, on))
                 for c in contexts]
        return np.asarray(self.phase.state.discriminator.score(items), dtype=np.float64)

    def cotrain(self, contexts, samples, step: int) -> dict:
        """The discriminator co-trained on one sample per context (the first: an unbiased draw) against the
        context's real turn."""
        from adversary.cotrain import cotrain_round

        from adversary.discriminator import with_end

        on = self.phase.cfg.disc_sees_end
        fresh = [(c.context, with_end(ts[0].text or "...", ts[0].ended, on), with_end(c.user_turn, c.is_last, on), c.id)
                 for c, ts in zip(contexts, samples)]
        cot = cotrain_round(self.phase.cfg, self.phase.state, fresh, step)
        return {k: v for k, v in cot.items() if k != "step"}

    def sampling_figures(self, samples) -> dict:
        flat = [t for ts in samples for t in ts]
        return {"round/truncated_rate": float(np.mean([t.truncated for t in flat])),
                "round/end_rate": float(np.mean([t.ended for t in flat]))}
