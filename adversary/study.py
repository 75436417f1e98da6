"""Controlled study: does the adversarial phase beat more SFT at equal compute?

    python -m adversary.study --config configs/study.yaml --out DIR

1. **The warm start, run to its SFT plateau** (cached in DIR/warmstart, shared by every arm): SFT on real user turns
   for up to `plateau_steps`, with the held-out td (on validation contexts: the test split is never used for a
   choice) and the perplexity of validation user turns read every `plateau_eval_every` steps; DIR/plateau.json and
   the curve in DIR/study.png show the knee.
2. **The arms, each given the same wall time** (`arm_seconds`, on the same machine, one after the other; the steps
   each got are reported): `sft` continues SFT on fresh real turns; any other arm runs the adversarial phase of the
   main job (its discriminator's initial fit included in its time) with the config's settings changed by the arm's
   spec, `LABEL:key=value,key=value` (e.g. `dpo_real:objective=dpo_rounds,round_chosen=real`). `guidance=K` in a
   spec makes a guided arm (`sft_guided:guidance=4`): trained as its label says for arm_seconds - guide_seconds,
   then a calibrated discriminator fitted on its own turns in the rest of its time keeps one of K sampled turns at
   every turn it writes (`adversary.guidance`). A trained arm leaves DIR/runs/<arm>/ARM.json; rerunning an
   interrupted study reuses those arms and trains the rest.
3. **Each arm's sampling temperature is chosen on validation contexts** (`temperatures`, by the fast panel's td),
   so that no arm wins by only learning a temperature.
4. **Scoring** (adversary/study_scoring.py), each arm as soon as it is trained: its final generator writes one turn
   for each of `study_contexts` held-out contexts (test split) at its temperature, once per fresh sampling seed
   (`study_seeds`); the detector panel (`study_detectors`) scores every arm and seed on the same contexts; an arm's
   td is the mean over its seeds, and td differences between arms get a paired bootstrap CI (contexts resampled
   jointly for every arm and seed, the panel maximum recomputed on each resample); realism diagnostics per arm; with
   `study_conversations`, each arm also continues held-out real conversations (conversation td, termination F1),
   and the arms' conversation td differences get the same paired CI, conversations resampled jointly.

Writes DIR/study.json (`differences` and `conversation_differences`: every pair of arms), DIR/plateau.json,
DIR/arms/<arm>.jsonl and <arm>.seed<N>.jsonl (each arm's simulated test turns per seed), DIR/arms/<arm>.score.json
and <arm>.conv.json (the cached scoring, with the detectors' out-of-fold records), DIR/real.jsonl and DIR/study.png.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conversations.cli_util import friendly_errors
from conversations.config import ConfigError
from conversations.seeds import seed_for
from adversary.study_scoring import (_panel_td, load_arm, paired_differences, score_arm,  # noqa: F401 (_panel_td: tests)
                                     score_conversations)

if TYPE_CHECKING:
    from adversary.config import AdversaryConfig


@dataclass
class StudyConfig:
    arms: list[str] = field(default_factory=lambda: ["sft", "grpo", "dpo:objective=dpo_rounds"], metadata={
        "help": "Arms: sft (continued SFT), or LABEL[:key=value,...] (the adversarial phase with those config keys "
                "changed; e.g. dpo_real:objective=dpo_rounds,round_chosen=real)."})
    arm_seconds: float = field(default=600.0, metadata={"help": "Wall time of each arm's training, in seconds."})
    study_contexts: int = field(default=1200, metadata={"help": "Held-out (test) contexts scored per arm."})
    study_seeds: list[int] = field(default_factory=lambda: [3001, 3002, 3003], metadata={
        "help": "Fresh sampling seeds of the final scoring (none is the meter's seed, on which the temperature is "
                "chosen): every arm simulates the test contexts once per seed; its td is the mean over the seeds, "
                "and the paired differences pool the seeds (one resample of contexts shared by all)."})
    val_contexts: int = field(default=300, metadata={"help": "Validation contexts for the temperature and the plateau curve."})
    temperatures: list[float] = field(default_factory=lambda: [0.8, 0.9, 1.0], metadata={
        "help": "Sampling temperatures each arm chooses from on the validation contexts."})
    study_detectors: list[str] = field(default_factory=lambda: ["classical", "style", "embed"], metadata={
        "help": "The detector panel of the final scoring."})
    study_folds: int = field(default=5, metadata={"help": "Cross-fitting folds of the final scoring."})
    n_boot: int = field(default=1000, metadata={"help": "Bootstrap resamples for CIs and paired differences."})
    plateau_steps: int = field(default=0, metadata={
        "help": "SFT steps of the shared warm start (0: warmstart_steps, no curve)."})
    plateau_eval_every: int = field(default=50, metadata={"help": "Steps between two readings of the plateau curve."})
    score_warmstart: bool = field(default=True, metadata={"help": "Also score the shared warm start as an arm."})
    guide_contexts: int = field(default=2048, metadata={
        "help": "A guided arm (`guidance=K` in its spec): the train contexts whose real turns and the arm's own turns "
                "fit and calibrate its guide (the discriminator-fit contexts, then fresh ones from the train split)."})
    guide_seconds: float = field(default=300.0, metadata={
        "help": "A guided arm's share of arm_seconds kept for its guide: its training gets arm_seconds - guide_seconds, "
                "then its guide is fitted on its own samples (simulation and fit measured, inside the arm's time)."})
    guide_calib_fraction: float = field(default=0.25, metadata={
        "help": "Share of the guide's contexts (whole conversations) held back to calibrate it on (Platt scaling)."})
    arm_readings: int = field(default=1, metadata={
        "help": "Readings along each arm: its generator is saved at arm_seconds x j / arm_readings for j = 1 .. "
                "arm_readings - 1 (at the first step or round that ends after it) and each one scored like the arm's "
                "end, as ARM@j (4: the quarters). The sft arm and the rounds objectives; 1: the end only."})
    study_conversations: int = field(default=0, metadata={
        "help": "Held-out real conversations each arm also continues, once per seed (the meter's conversation level: "
                "conversation td, termination F1, ends and turns per real; adversary.conversation_meter); 0: turns "
                "only. A guided arm's turns are its guide's picks here too; with end_decision calibrated, each arm's end "
                "offset is solved once on its own turns first. Cached per arm, so a rerun with it set adds the level "
                "to arms already scored."})

    def __post_init__(self):
        if not self.arms:
            raise ConfigError("arms: give at least one arm")
        for a in self.arms:
            parse_arm(a)
        if not self.study_seeds:
            raise ConfigError("study_seeds: give at least one seed")
        if self.study_contexts < 20 or self.val_contexts < 20:
            raise ConfigError("study_contexts and val_contexts must be >= 20")
        if self.arm_seconds <= 0:
            raise ConfigError("arm_seconds must be > 0")
        if not self.temperatures or min(self.temperatures) <= 0:
            raise ConfigError("temperatures must be a non-empty list of values > 0")
        if not 0 < self.guide_seconds < self.arm_seconds and any(parse_arm(a)[2] for a in self.arms):
            raise ConfigError(f"guide_seconds must be in (0, arm_seconds = {self.arm_seconds}) for a guided arm, got "
                              f"{self.guide_seconds}")
        if not 0.05 <= self.guide_calib_fraction <= 0.5 or self.guide_contexts < 64:
            raise ConfigError("guide_calib_fraction must be in [0.05, 0.5] and guide_contexts >= 64")
        if self.arm_readings < 1:
            raise ConfigError(f"arm_readings must be >= 1 (1: the arm's end only), got {self.arm_readings}")
        if self.plateau_steps < 0 or self.plateau_eval_every < 1:
            raise ConfigError("plateau_steps must be >= 0 and plateau_eval_every >= 1")


GUIDE_KEYS = ("guidance", "guide_rule")  # an arm's keys that are not config fields: its guided decoding


def parse_arm(spec: str) -> tuple[str, dict[str, str], dict]:
    """'LABEL:key=value,key=value' -> (LABEL, {config key: value}, guidance). The guidance ({} when the arm has
    none): `guidance=K` (K >= 2 candidates a turn) and `guide_rule=resample|argmax` (resample by default) make the
    arm a guided one: trained as its label says, then decoded through a guide fitted on its own samples."""
    from adversary.guidance import RULES

    label, _, rest = spec.partition(":")
    overrides = {}
    for kv in filter(None, rest.split(",")):
        k, eq, v = kv.partition("=")
        if not eq or not k:
            raise ConfigError(f"arms: '{spec}': each override is key=value")
        overrides[k.strip()] = v.strip()
    if not label:
        raise ConfigError(f"arms: '{spec}' has no label")
    guide = {k: overrides.pop(k) for k in GUIDE_KEYS if k in overrides}
    if guide:
        try:
            k = int(guide.get("guidance", ""))
        except ValueError:
            k = 0
        rule = guide.get("guide_rule", "resample")
        if k < 2 or rule not in RULES:
            raise ConfigError(f"arms: '{spec}': a guided arm needs guidance=K with K >= 2 and guide_rule in {RULES}")
        guide = {"k": k, "rule": rule}
    return label, overrides, guide


def parse(argv):
    from adversary.config import parse_job

    argv = ["--output_dir" if a == "--out" else a for a in (sys.argv[1:] if argv is None else argv)]
    return parse_job((StudyConfig,), argv, prog="python -m adversary.study")


def arm_config(cfg: AdversaryConfig, args, overrides: dict[str, str]):
    """Copies of (cfg, args) with an arm's overrides, each parsed as its field's type."""
    import dataclasses
    import typing

    cfg, args = copy.deepcopy(cfg), copy.deepcopy(args)
    for k, v in overrides.items():
        target = cfg if k in {f.name for f in dataclasses.fields(cfg)} else args if hasattr(args, k) else None
        if target is None:
            raise ConfigError(f"arms: unknown key '{k}'")
        tp = typing.get_type_hints(type(target)).get(k) or type(getattr(target, k))
        args_ = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = args_[0] if args_ and typing.get_origin(tp) is not list else tp
        scalar = {int: int, float: float, bool: lambda x: x.lower() in ("1", "true", "yes")}
        if typing.get_origin(tp) is list:  # a list's items are separated by spaces (commas separate overrides)
            item = scalar.get((typing.get_args(tp) or (str,))[0], str)
            cast = lambda x, item=item: [item(e) for e in x.split()]  # noqa: E731
        else:
            cast = scalar.get(tp, str)
        try:
            setattr(target, k, cast(v))
        except ValueError:
            raise ConfigError(f"arms: '{k}={v}' is not a valid {getattr(tp, '__name__', tp)}") from None
    cfg.__post_init__()  # the overrides are checked like any config value
    return cfg, args


# ------------------------------------------------------------------------------------------------ the warm start


def plateau_warm_start(cfg: AdversaryConfig, args, study, data, out: Path) -> tuple[str, list[dict]]:
    """SFT to the plateau, cached in OUT/warmstart: (merged model dir, curve rows)."""
    from transformers import TrainerCallback

    from adversary.heldout import heldout_settings, simulate_heldout
    from discriminator.turing import measure_td
    from generator.engine import policy_model
    from adversary.stages import warm_start_config
    from generator.sft import heldout_perplexity, run_sft

    wdir = out / "warmstart"
    if (wdir / "COMPLETE").exists():
        doc = json.loads((wdir / "COMPLETE").read_text())
        return doc["merged_dir"], doc["curve"]
    steps = study.plateau_steps or cfg.warmstart_steps
    curve: list[dict] = []
    ppl_kw = dict(max_context_tokens=cfg.max_context_tokens, max_length=cfg.warmstart_max_length)
    ppl_items = data.val[:128]

    def read(model, tok, step: int, seconds: float):
        t0 = time.time()
        with policy_model(model, precision=cfg.dtype) as frozen:
            sims = simulate_heldout(frozen, tok, data.val, cfg, precision=cfg.dtype, settings=heldout_settings(cfg))
        del frozen
        rep = measure_td(data.val, sims, detectors=("classical", "style"), folds=cfg.heldout_folds, seed=args.seed,
                         n_boot=200)
        ppl = heldout_perplexity(model, tok, ppl_items, **ppl_kw)
        row = {"step": step, "td": rep["td"], "td_ci95": rep["td_ci95"], "val_ppl": ppl, "train_seconds": seconds,
               "truncated_rate": float(np.mean([s.meta["truncated"] for s in sims])),
               "end_rate": float(np.mean([s.meta["ended"] for s in sims])), "eval_seconds": time.time() - t0}
        curve.append(row)
        print(f"[plateau] step {step}: td {row['td']:.1f} ({row['td_ci95'][0]:.1f}-{row['td_ci95'][1]:.1f}), val ppl "
              f"{ppl:.1f}, truncated {row['truncated_rate']:.2f}, ends {row['end_rate']:.2f}", flush=True)

    class Curve(TrainerCallback):
        def __init__(self):
            self.trained = 0.0
            self.t0 = None

        def on_step_begin(self, a, s, c, **k):
            self.t0 = time.time()

        def on_step_end(self, a, s, c, model=None, processing_class=None, **k):
            self.trained += time.time() - self.t0
            if s.global_step % study.plateau_eval_every == 0 or s.global_step == s.max_steps:
                read(model, processing_class, s.global_step, self.trained)

    sft_args, config = warm_start_config(cfg, args, wdir, steps, args.seed, lr_scheduler_type="constant",
                                         warmup_ratio=0.0)
    config.logging_steps = max(1, study.plateau_eval_every)
    turns = data.warmstart + data.rest[: max(0, steps * cfg.warmstart_batch_size - len(data.warmstart))]
    cb = Curve() if study.plateau_steps else None
    m = run_sft(sft_args, config, train_records=turns, eval_records=[], callbacks=[cb] if cb else None)
    wdir.mkdir(parents=True, exist_ok=True)
    (wdir / "COMPLETE").write_text(json.dumps({"merged_dir": m["merged_dir"], "curve": curve,
                                               "train_runtime_s": m["train_runtime_s"], "turns": len(turns)}))
    return m["merged_dir"], curve


# ------------------------------------------------------------------------------------------------------------- arms


def reading_seconds(study) -> list[float]:
    """The times along an arm at which its generator is saved for a reading (the arm's end is read anyway)."""
    return [study.arm_seconds * j / study.arm_readings for j in range(1, study.arm_readings)]


def run_sft_arm(cfg: AdversaryConfig, args, study, data, start_model: str, out: Path) -> dict:
    from adversary.trainer_parts import Snapshots, TimeBudget
    from adversary.stages import warm_start_config
    from generator.sft import run_sft

    t0 = time.time()
    sft_args, config = warm_start_config(cfg, args, out, 100_000, seed_for("study_warm_start", args.seed),
                                         lr_scheduler_type="constant", warmup_ratio=0.0)
    sft_args.model = start_model
    # fresh turns, never the warm start's: the end of the rest of the train split, in its seeded order; enough for a
    # step a second (building each example costs ~3 ms, inside the arm's time)
    n = min(len(data.rest) // 2, int(study.arm_seconds) * cfg.warmstart_batch_size + cfg.warmstart_batch_size)
    snaps = Snapshots(reading_seconds(study), t0, out)
    m = run_sft(sft_args, config, train_records=data.rest[-n:], eval_records=[],
                callbacks=[TimeBudget(study.arm_seconds, start=t0), snaps])
    curve = [{"step": h["step"], "loss": h["loss"]} for h in m["loss_history"]]
    return {"steps": m["train_steps"], "wall_seconds": time.time() - t0, "model_dir": m["merged_dir"], "curve": curve,
            "readings": snaps.readings}


def run_adversarial_arm(cfg: AdversaryConfig, args, study, data, start_model: str, out: Path) -> dict:
    """The arm's objective (adversary/objectives/) for `arm_seconds`, its discriminator's initial fit included; no
    meter (the arm trains for its whole time), the adapter saved to OUT/model."""
    from adversary.objectives import get_objective
    from adversary.objectives.base import Phase
    from adversary.stages import fit_discriminator, make_discriminator
    from adversary.state import AdversaryState
    from generator.model import load_generator

    t0 = time.time()
    cfg.phase_seconds = study.arm_seconds
    args.max_steps = 100_000  # the time budget ends the arm
    model, tok = load_generator(start_model, trust_remote_code=args.trust_remote_code)
    state = AdversaryState(cfg, make_discriminator(cfg, args.seed), max_steps=None, seed=args.seed)
    fit_discriminator(cfg, state.discriminator, model, tok, data, args.seed)
    phase = Phase(cfg, args, model, tok, state, data, meter=None, start_time=t0,
                  snapshot_seconds=reading_seconds(study))
    res = get_objective(cfg.objective)(phase).run()
    res.model.save_pretrained(str(out / "model"))
    tok.save_pretrained(str(out / "model"))
    return {"steps": res.steps, "wall_seconds": time.time() - t0, "model_dir": str(out / "model"), "curve": res.curve,
            "cotrain": state.cotrain_history, "readings": phase.readings}


def run_guided_arm(run, cfg: AdversaryConfig, args, study, data, start_model: str, out: Path, guide_spec: dict) -> dict:
    """A guided arm: `run` (the SFT or the adversarial arm) trains for arm_seconds - guide_seconds, then the
    trained simulator's own turns on `guide_contexts` train contexts (at the config's sampling temperature) and
    their real turns fit and calibrate its guide (`adversary.guidance.fit_guide`), saved to OUT/guide. The wall time
    reported is the whole arm's, the guide included."""
    from adversary.guidance import fit_guide
    from adversary.heldout import heldout_settings
    from adversary.stages import make_discriminator
    from generator.engine import Engine
    from generator.sample import simulate_records

    t0 = time.time()
    train_study = copy.copy(study)  # not dataclasses.replace: its checks would measure guide_seconds against the cut
    train_study.arm_seconds = study.arm_seconds - study.guide_seconds
    res = run(cfg, args, train_study, data, start_model, out)
    t_guide = time.time()
    contexts = data.disc_fit + data.rest[: max(0, study.guide_contexts - len(data.disc_fit))]
    model, tok = load_arm(res["model_dir"], cfg, args)
    settings = heldout_settings(cfg)
    sims = simulate_records(Engine(model, tok, batch_size=cfg.sim_batch_size, precision=cfg.dtype), contexts,
                            settings, seed=seed_for("fit_samples", args.seed))
    guide = fit_guide(make_discriminator(cfg, args.seed), contexts, sims, study.guide_calib_fraction, guide_spec["k"],
                      guide_spec["rule"], epochs=cfg.disc_epochs)
    del model
    guide.save(out / "guide")
    cal = guide.report["heldback"]
    print(f"guide: {guide.report['fit_items']} turns fitted, held-back pairs acc {cal['raw']['accuracy']:.3f}, ECE "
          f"{cal['raw']['ece']:.3f} -> {cal['calibrated']['ece']:.3f}, {time.time() - t_guide:.0f}s", flush=True)
    res["guide"] = {**guide_spec, "dir": str(out / "guide"), "report": guide.report, "fit_temperature":
                    settings.temperature, "seconds": round(time.time() - t_guide, 1),
                    "train_seconds": round(t_guide - t0, 1)}
    res["wall_seconds"] = time.time() - t0
    return res


@friendly_errors
def main(argv=None) -> int:
    from adversary.config import resolved as resolved_config
    from adversary.stages import prepare_data
    from conversations.cli_util import quiet_libraries
    from conversations.config import to_jsonable
    from conversations.loaders import write_jsonl

    quiet_libraries()
    cfg, args, study = parse(argv)
    from conversations.cli_util import start_process

    start_process()
    t_start = time.time()
    out = Path(args.output_dir)
    cfg.heldout_contexts = study.study_contexts
    cfg.conv_contexts = study.study_conversations  # prepare_data draws the held-out conversations
    if study.plateau_steps:
        cfg.warmstart_steps = study.plateau_steps  # the warm start's turns are drawn for the whole plateau run
    args.save_strategy = "no"
    arms = [parse_arm(a) for a in study.arms]
    for label, overrides, _ in arms:  # every arm's keys checked now, not after the warm start
        arm_cfg, arm_args = arm_config(cfg, args, overrides)
        if not label.startswith("sft"):
            from adversary.stages import check_recipe

            check_recipe(arm_cfg, arm_args)
    (out / "arms").mkdir(parents=True, exist_ok=True)  # after the checks: a bad command line leaves nothing behind
    data = prepare_data(cfg, args.seed, val_contexts=study.val_contexts)
    print(f"study: {len(data.heldout)} test contexts x {len(study.study_seeds)} seeds, {len(data.val)} validation "
          f"contexts, arms {[a for a, _, _ in arms]}, {study.arm_seconds:.0f}s each", flush=True)
    write_jsonl(out / "real.jsonl", data.heldout)

    start_model, plateau = plateau_warm_start(cfg, args, study, data, out)
    (out / "plateau.json").write_text(json.dumps(plateau, indent=2))
    todo = [("warmstart", {}, {})] if study.score_warmstart else []
    summary, reports, conv_reports = {}, {}, {}
    for label, overrides, guide_spec in todo + arms:
        # each arm is trained, then scored at once: an interrupted study keeps every arm it finished
        if label == "warmstart":
            res = {"steps": 0, "model_dir": start_model, "wall_seconds": 0.0, "curve": []}
        else:
            arm_cfg, arm_args = arm_config(cfg, args, overrides)
            arm_out = out / "runs" / label
            arm_args.output_dir = str(arm_out)
            if (arm_out / "ARM.json").exists():  # trained by an earlier, interrupted run of the same study
                res = json.loads((arm_out / "ARM.json").read_text())
                print(f"arm {label}: reusing {arm_out}", flush=True)
            else:
                print(f"arm {label}: training for {study.arm_seconds:.0f}s", flush=True)
                run = run_sft_arm if label.startswith("sft") else run_adversarial_arm
                if guide_spec:
                    res = run_guided_arm(run, arm_cfg, arm_args, study, data, start_model, arm_out, guide_spec)
                else:
                    res = run(arm_cfg, arm_args, study, data, start_model, arm_out)
                res["overrides"] = overrides
                (arm_out / "ARM.json").write_text(json.dumps(res, default=float))
                print(f"arm {label}: {res['steps']} steps in {res['wall_seconds']:.0f}s", flush=True)
        for r in [] if guide_spec else res.get("readings", []):  # the readings along the arm, each scored as its end
            name = f"{label}@{r['reading'] + 1}"
            part = {"steps": r["step"], "wall_seconds": r["seconds"], "model_dir": r["model_dir"], "curve": [],
                    "overrides": res.get("overrides", {})}
            summary[name], part_oofs = score_arm(name, part, cfg, args, study, data, out)
            reports[name] = {"td": summary[name]["td"], "oof": part_oofs}
        summary[label], oofs = score_arm(label, res, cfg, args, study, data, out)
        if study.study_conversations:  # a guided arm's conversations are guided turn by turn, as its turns are
            conv, conv_oofs = score_conversations(label, res, cfg, args, study, data, out,
                                                  summary[label]["temperature"])
            summary[label]["conversation"] = conv
            conv_reports[label] = {"td": conv["conv/td"], "oof": conv_oofs}
        reports[label] = {"td": summary[label]["td"], "oof": oofs}

    diffs = paired_differences(reports, [r.id for r in data.heldout], study.n_boot, args.seed)
    # the conversation level's differences: held-out conversations resampled jointly for every arm and seed
    conv_diffs = paired_differences(conv_reports, [str(c.id) for c in data.heldout_convs], study.n_boot, args.seed)
    doc = {"n_contexts": len(data.heldout), "seeds": study.study_seeds, "n_val_contexts": len(data.val),
           "arm_seconds": study.arm_seconds, "arms": summary, "differences": diffs,
           "conversation_differences": conv_diffs, "plateau": plateau,
           "wall_seconds": round(time.time() - t_start, 1),
           "config": {"adversary": resolved_config(cfg), "grpo": to_jsonable(args), "study": to_jsonable(study)}}
    (out / "study.json").write_text(json.dumps(doc, indent=2, default=float))
    from adversary.curves import plot_study

    plot_study(doc, out / "study.png")
    for k, d in diffs.items():
        print(f"td difference {k}: {d['td_difference']:+.1f} (95% CI {d['ci95'][0]:+.1f} to {d['ci95'][1]:+.1f})")
    for k, d in conv_diffs.items():
        print(f"conversation td difference {k}: {d['td_difference']:+.1f} (95% CI {d['ci95'][0]:+.1f} to "
              f"{d['ci95'][1]:+.1f})")
    print(f"study done in {doc['wall_seconds'] / 60:.1f} min: {out / 'study.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
