"""Held-out Turing distance: a fixed set of test-split contexts (never used to train the generator or the
discriminator), one simulated turn each with a fixed sampling seed (the same at every evaluation, so that readings
differ by the generator, not by sampling luck), scored by a freshly trained detector panel (`discriminator.turing`).

Under several processes each rank simulates its shard of the contexts; the main process measures.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from adversary.conversation_meter import (calibrated_end_bias, conversation_line, measure_conversations,
                                         simulate_heldout_conversations)
from adversary.crashpoints import crash_point
from conversations.schema import TurnRecord
from conversations.seeds import seed_for
from discriminator.turing import measure_td
from generator.diagnostics import realism_diagnostics
from generator.engine import Engine, SamplingSettings
from generator.sample import simulate_candidates

if TYPE_CHECKING:
    from adversary.config import AdversaryConfig, MeterArgs

HELDOUT_SEED = 1234  # the meter's sampling seed: the same at every evaluation of a run


def heldout_settings(cfg: AdversaryConfig, temperature: float | None = None) -> SamplingSettings:
    """The sampling settings of held-out simulation (and of the export): the meter's token budget, the simulator's
    prompt budget and the config's sampling temperature / top-p."""
    return SamplingSettings(max_new_tokens=cfg.heldout_max_new_tokens, max_prompt_tokens=cfg.max_context_tokens,
                            temperature=cfg.sim_temperature if temperature is None else temperature,
                            top_p=cfg.sim_top_p)


def simulate_heldout(model, tokenizer, records: list[TurnRecord], cfg: AdversaryConfig, accelerator=None,
                     seed: int = HELDOUT_SEED, precision: str | None = None,
                     settings: SamplingSettings | None = None) -> list[TurnRecord]:
    """Simulate one turn per held-out context (sharded over ranks when `accelerator` has several processes)."""
    return simulate_heldout_samples(model, tokenizer, records, cfg, 1, accelerator, seed, precision, settings)[0]


def simulate_heldout_samples(model, tokenizer, records: list[TurnRecord], cfg: AdversaryConfig, n: int,
                             accelerator=None, seed: int = HELDOUT_SEED, precision: str | None = None,
                             settings: SamplingSettings | None = None) -> list[list[TurnRecord]]:
    """`n` simulated turns per held-out context in one call, each context prefilled once (`simulate_candidates`):
    `n` lists of one turn per context, sample j of every context in list j. The meter reads each list with its own
    panel: independent draws per context, as `n` sampling seeds would give, for one prefill instead of `n`. Sharded
    over ranks when `accelerator` has several processes."""
    n_proc = accelerator.num_processes if accelerator is not None else 1
    rank = accelerator.process_index if accelerator is not None else 0
    per = math.ceil(len(records) / n_proc)
    shard = records[rank * per : (rank + 1) * per]
    # equal shard sizes: under ZeRO-3 every rank must run the same number of forward passes
    shard = shard + records[: per - len(shard)] if len(shard) < per else shard
    crash_point("generation")
    engine = Engine(model, tokenizer, batch_size=cfg.sim_batch_size, precision=precision)
    cands = simulate_candidates(engine, shard, settings or heldout_settings(cfg), n, seed=seed + rank)  # [shard][n]
    if n_proc > 1:
        from accelerate.utils import gather_object

        cands = gather_object(cands)
    seen, kept = set(), []
    for cs in cands:
        if cs[0].id not in seen:
            seen.add(cs[0].id)
            kept.append([TurnRecord(id=c.id, context=c.context, user_turn=c.user_turn,
                                    conversation_id=c.conversation_id,
                                    meta={k: v for k, v in c.meta.items() if k != "candidate"}) for c in cs])
    return [[cs[j] for cs in kept] for j in range(n)]


def mean_rows(rows: list[dict]) -> dict:
    """One reading from the readings of several samples per context (seeds, or `simulate_heldout_samples`' lists):
    every numeric key averaged (the CI bounds too: the mean of the intervals), the text keys of the first;
    `td/seeds` (how many) and `td/seed_sd` (the spread of the panel td over them) added."""
    import numpy as np

    if len(rows) == 1:
        return {**rows[0], "td/seeds": 1, "td/seed_sd": 0.0}
    out = {}
    for k, v in rows[0].items():
        vals = [r.get(k) for r in rows]
        numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in vals)
        out[k] = float(np.mean(vals)) if numeric else v
    out["td/seeds"] = len(rows)
    out["td/seed_sd"] = float(np.std([r["td/panel"] for r in rows], ddof=1))
    return out


def measure_heldout(real: list[TurnRecord], sims: list[TurnRecord], cfg: MeterArgs, seed: int = 0) -> dict:
    """One row of the td curve: panel td with CI, each detector's td, AUC, paired accuracy, diagnostics. The
    simulated turns come from `simulate_heldout` (end marker already stripped, `meta["ended"]` set there)."""
    t0 = time.perf_counter()
    clean = [s if s.user_turn.strip() else TurnRecord(id=s.id, context=s.context, user_turn="...",
                                                       conversation_id=s.conversation_id, meta=s.meta) for s in sims]
    report = measure_td(real, clean, detectors=tuple(cfg.heldout_detectors), folds=cfg.heldout_folds, seed=seed)
    lo, hi = report["td_ci95"]
    # the row's keys are the logged metric names (TensorBoard, curves.csv, the manifest): one name per thing
    row = {
        "td/panel": report["td"],
        "td/ci_low": lo,
        "td/ci_high": hi,
        "td/signed": report["signed"],
        "td/auc": report["auc"],
        "td/log_loss": report["log_loss"],
        "td/paired_accuracy": report.get("paired_accuracy"),
        "td/headline": report.get("headline_detector"),
    }
    for name, d in report["detectors"].items():
        row[f"td/{name}"] = d["td"]
    for k, v in realism_diagnostics(sims, real).items():
        row[f"diag/{k}"] = v
    row["td/meter_seconds"] = time.perf_counter() - t0
    return row


class HeldoutMeter:
    """One held-out evaluation, the same for every objective: every rank simulates its shard of the held-out
    contexts with the model `generation` yields; the main process measures the panel td, the training
    discriminator's own accuracy on the same real and simulated turns (`disc/heldout_acc`: how far ahead of the
    generator it is), updates the gate and rewrites the curve files; the row and the gate's decision are broadcast."""

    def __init__(self, cfg: AdversaryConfig, data, tokenizer, state, out_dir):
        self.cfg, self.data, self.tok, self.state = cfg, data, tokenizer, state
        self.out = out_dir

    def evaluate(self, step: int, generation, accelerator=None, extra: dict | None = None) -> tuple[dict, bool, bool]:
        """(row, stop, is_best). `generation`: a context manager yielding the model to simulate with."""
        from accelerate.utils import broadcast_object_list
        from sklearn.metrics import accuracy_score

        from adversary.gate import PlateauGate, Reading

        from conversations.memory import release_memory

        is_main = accelerator is None or accelerator.is_main_process
        t0 = time.perf_counter()
        release_memory()  # the simulation's cache lands on a trimmed heap, not on what training left (the run's peak)
        # the same at every reading
        seed = seed_for("meter_seed", HELDOUT_SEED, 0)
        # conv_readings first_and_best: the conversations at the first reading only; best: at none (the best
        # checkpoint's are read after the phase, read_best_conversations)
        when = self.cfg.conv_readings
        convs = getattr(self.data, "heldout_convs", None) \
            if when == "every" or (when == "first_and_best" and not self.state.rows) else None
        with generation as model:
            # meter_seeds samples per context, one prefill each: the reading is the mean of their panels
            per_seed = simulate_heldout_samples(model, self.tok, self.data.heldout, self.cfg, self.cfg.meter_seeds,
                                                accelerator, seed=seed, precision=self.cfg.dtype)
            # every rank continues the same conversations (the same seed): under sharded weights all ranks must
            # run the same forwards
            sim_convs, end_bias = self._continue(model, convs) if convs else (None, None)
            del model  # the copy goes as the context closes, not when this method returns
        sims = per_seed[0]
        payload = [None]
        if is_main:
            row = {"step": step, **mean_rows([measure_heldout(self.data.heldout, s, self.cfg) for s in per_seed])}
            items = list(self.data.heldout) + sims
            if self.cfg.disc_sees_end:  # the discriminator's own view: ends marked
                from adversary.discriminator import with_end

                ends = [r.is_last for r in self.data.heldout] + [s.meta.get("ended", False) for s in sims]
                items = [TurnRecord(id=r.id, context=r.context, user_turn=with_end(r.user_turn or "...", e, True))
                         for r, e in zip(items, ends)]
            y = [1] * len(self.data.heldout) + [0] * len(sims)
            row["disc/heldout_acc"] = float(accuracy_score(y, (self.state.discriminator.score(items) > 0).astype(int)))
            if sim_convs is not None:
                row.update(measure_conversations(convs, sim_convs, self.cfg))
                if end_bias is not None:
                    row["conv/end_bias"] = end_bias
            row.update(extra or {})
            level = "conv/td" if self.cfg.gate_level == "conversation" else "td/panel"
            lo, hi = ("conv/ci_low", "conv/ci_high") if level == "conv/td" else ("td/ci_low", "td/ci_high")
            decision = self.state.gate.update(Reading(step, row[level], row[lo], row[hi]))
            row["td/eval_seconds"] = time.perf_counter() - t0
            payload = [{"row": row, "stop": decision.stop, "is_best": decision.is_best,
                        "gate": self.state.gate.state_dict()}]
        if accelerator is not None and accelerator.num_processes > 1:
            broadcast_object_list(payload, from_process=0)
        res = payload[0]
        if not is_main:  # keep the gate identical everywhere
            self.state.gate = PlateauGate.from_state_dict(res["gate"])
        self.state.rows.append(res["row"])
        self.state.meter_seconds += time.perf_counter() - t0
        if is_main:
            self.write_outputs()
            r = res["row"]
            print(f"[td] step {step}: td {r['td/panel']:.1f} (95% CI {r['td/ci_low']:.1f}-{r['td/ci_high']:.1f}), "
                  f"auc {r['td/auc']:.3f}, discriminator acc on held-out {r['disc/heldout_acc']:.3f}, "
                  f"truncated {r.get('diag/truncated_rate', 0):.2f}, ends {r.get('diag/end_rate', 0):.2f}"
                  f"{conversation_line(r)}"
                  f"{'  best' if res['is_best'] else ''}"
                  f"{'  -> gate: ' + self.state.gate.describe() if res['stop'] else ''}", flush=True)
        return res["row"], res["stop"], res["is_best"]

    def _continue(self, model, convs) -> tuple[list, float | None]:
        """(simulated conversations, the end offset solved for `model` or None): the conversation level's sampling,
        at the first meter seed."""
        seed = seed_for("meter_seed", HELDOUT_SEED, 0)
        settings, end_bias = heldout_settings(self.cfg), None
        if self.data.end_contexts:  # end_decision: calibrated
            end_bias = calibrated_end_bias(model, self.tok, self.data.end_contexts, self.cfg, settings,
                                           self.data.real_end_rate, seed, precision=self.cfg.dtype)
            settings = settings.replace(end_bias=end_bias)
        sims = simulate_heldout_conversations(model, self.tok, convs, self.cfg, settings, seed,
                                              precision=self.cfg.dtype)
        return sims, end_bias

    def read_best_conversations(self, best_dir, trust_remote_code: bool = False) -> dict | None:
        """conv_readings first_and_best or best: the conversation level of the best checkpoint (`best_dir`, merged as
        the export merges it), read once after the phase into its row of the curve, so that the manifest and the
        export's end offset have it. The row it completed, or None when there is nothing to read (its row has the
        conversations already: every reading, or first_and_best with the first reading the best)."""
        from accelerate import PartialState

        from generator.model import load_generator

        convs, best = getattr(self.data, "heldout_convs", None), self.state.gate.best
        row = next((r for r in self.state.rows if best is not None and r["step"] == best.step), None)
        if not convs or row is None or "conv/td" in row:
            return None
        ps = PartialState()
        if ps.is_main_process:
            t0 = time.perf_counter()
            model, _ = load_generator(str(best_dir), trust_remote_code=trust_remote_code)
            sims, end_bias = self._continue(model, convs)
            del model
            row.update(measure_conversations(convs, sims, self.cfg))
            if end_bias is not None:
                row["conv/end_bias"] = end_bias
            row["conv/read_after_phase"] = 1  # the gate did not read it: it picked this step on turns
            seconds = time.perf_counter() - t0  # its own stage in summary.json (best_conversations), not the phase's
            self.write_outputs()
            print(f"[td] step {row['step']} (best), read after the phase in {seconds:.0f}s{conversation_line(row)}",
                  flush=True)
        ps.wait_for_everyone()
        return row

    def write_outputs(self) -> None:
        from adversary.curves import plot_curves, write_curves

        gate = self.state.gate
        write_curves(self.state.rows, self.out / "curves.csv")
        freeze = self.state.rows[-1]["step"] if gate.stopped else None
        plot_curves(self.state.rows, self.out / "turing_curve.png", freeze_step=freeze,
                    best_step=gate.best.step if gate.best else None)
