"""Controlled study: does the adversarial phase beat more SFT at equal compute?

    python -m adversary.study --config configs/study.yaml --out DIR

From one shared warm-started checkpoint, with the same seeds, data order and number of generator updates:
- arm `adversarial`: the main job's adversarial phase as configured (discriminator reward + realism terms);
- arm `sft`: the same number of generator steps of plain SFT on real user turns, same LoRA, same learning-rate
  schedule (and the same number of sequences per step as GRPO has prompts x generations);
- arm `adversarial_plain` (optional): adversarial with the realism terms switched off;
- the shared warm start itself is scored too, as the reference point.
Each arm's final generator writes one turn per held-out context (test split, never used by any arm); the full
detector panel scores every arm on the same contexts; TD differences between arms get a paired bootstrap CI
(contexts resampled jointly, the panel maximum recomputed on each resample).

Writes DIR/study.json, DIR/arms/<arm>.jsonl, DIR/real.jsonl, DIR/study.png.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conversations.cli_util import friendly_errors
from conversations.config import ConfigError

ARMS = ("adversarial", "sft", "adversarial_plain")


@dataclass
class StudyConfig:
    arms: list[str] = field(default_factory=lambda: ["adversarial", "sft", "adversarial_plain"], metadata={
        "help": "Arms to run: adversarial, sft, adversarial_plain (adversarial without the realism terms)."})
    study_contexts: int = field(default=600, metadata={"help": "Held-out contexts scored per arm (one turn each)."})
    study_detectors: list[str] = field(default_factory=lambda: ["classical", "style", "neural"], metadata={
        "help": "The detector panel of the final scoring."})
    study_folds: int = field(default=5, metadata={"help": "Cross-fitting folds of the final scoring."})
    n_boot: int = field(default=1000, metadata={"help": "Bootstrap resamples for CIs and paired differences."})
    score_warmstart: bool = field(default=True, metadata={
        "help": "Also score the shared warm start (the arms' starting point); costs one more arm's scoring."})

    def __post_init__(self):
        bad = [a for a in self.arms if a not in ARMS]
        if bad or not self.arms:
            raise ConfigError(f"arms: unknown {bad} (choose from {', '.join(ARMS)})")
        if self.study_contexts < 20:
            raise ConfigError("study_contexts must be >= 20")


def parse(argv):
    from adversary.config import parse_job

    argv = ["--output_dir" if a == "--out" else a for a in (sys.argv[1:] if argv is None else argv)]
    return parse_job((StudyConfig,), argv, prog="python -m adversary.study")


# ------------------------------------------------------------------------------------------------------------- arms


def run_adversarial_arm(cfg, args, data, start_model: str, out: Path) -> dict:
    from adversary.cotrain import FaultCounter, ReplayBuffer
    from adversary.gate import PlateauGate
    from adversary.loop import build_trainer
    from adversary.stages import fit_discriminator, make_discriminator
    from generator.model import load_generator

    t0 = time.time()
    model, tok = load_generator(start_model, trust_remote_code=args.trust_remote_code)
    disc = make_discriminator(cfg, args.seed)
    fit_discriminator(cfg, disc, model, tok, data, args.seed)
    trainer, _, cotrain = build_trainer(cfg, args, model, tok, disc, data, gate=PlateauGate(), rows=[],
                                        buffer=ReplayBuffer(cfg.replay_size, seed=args.seed),
                                        faults=FaultCounter(cfg.max_faults), heldout=False)
    trainer.train()
    trainer.save_model(str(out / "model"))
    # the co-training metrics are not in log_history (callbacks add them to the logs after it is written): take the
    # discriminator's accuracy from the co-training history, the latest round at or before each logged step
    rounds = [(h["step"], h["disc/acc"]) for h in cotrain.history]

    def disc_acc(step):
        before = [a for s, a in rounds if s <= step and a == a]
        return before[-1] if before else None

    curve = [{"step": h["step"], "reward": h.get("reward"), "disc_acc": disc_acc(h["step"]), "kl": h.get("kl")}
             for h in trainer.state.log_history if "reward" in h]
    return {"steps": trainer.state.global_step, "wall_seconds": time.time() - t0, "model_dir": str(out / "model"),
            "curve": curve}


def run_sft_arm(cfg, args, data, start_model: str, out: Path) -> dict:
    from generator.data import sample_records
    from generator.sft import SFTArgs, run_sft

    t0 = time.time()
    # same number of updates, same LoRA and schedule, and as many sequences per step as GRPO scores per step
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
    sft_args = SFTArgs(
        model=start_model, output_dir=str(out), max_steps=args.max_steps,
        per_device_train_batch_size=min(per_step, cfg.warmstart_micro_batch),
        gradient_accumulation_steps=max(1, per_step // min(per_step, cfg.warmstart_micro_batch)),
        learning_rate=args.learning_rate, lr_scheduler_type=str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
        warmup_ratio=0.0, lora_r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
        max_context_messages=cfg.max_context_messages, max_context_tokens=cfg.max_context_tokens,
        max_turn_chars=cfg.max_turn_chars, max_length=cfg.warmstart_max_length, seed=args.seed + 7,
        eval_turns=0, save_adapter=False, save_merged=True, trust_remote_code=args.trust_remote_code,
        dtype=cfg.dtype,
    )
    n = args.max_steps * per_step
    # fresh turns, not the warm start's: the warm start drew with seed `args.seed`
    m = run_sft(sft_args, train_records=sample_records(data.train, n, seed=args.seed + 7), eval_records=[])
    curve = [{"step": h["step"], "loss": h["loss"]} for h in m["loss_history"]]
    return {"steps": m["train_steps"], "wall_seconds": time.time() - t0, "model_dir": m["merged_dir"], "curve": curve}


# --------------------------------------------------------------------------------------------------------- scoring


def simulate_arm(model_dir: str, data, cfg, args):
    from adversary.heldout import simulate_heldout
    from generator.model import load_generator

    from conversations.precision import inference_dtype

    model, tok = load_generator(model_dir, trust_remote_code=args.trust_remote_code, dtype=inference_dtype(cfg.dtype))
    return simulate_heldout(model, tok, data.heldout, cfg, precision=cfg.dtype)


def _panel_td(correct: np.ndarray, weights: np.ndarray) -> float:
    """Panel td on a weighted resample: per detector accuracy, then the maximum |acc - 50|."""
    acc = 100.0 * (correct * weights[None, :]).sum(1) / weights.sum()
    return float(np.max(np.abs(acc - 50.0)))


def paired_differences(reports: dict, real_ids: list[str], n_boot: int, seed: int) -> dict:
    """td(arm) - td(other) with a 95% CI from resampling held-out contexts jointly across arms."""
    ctx_index = {rid: i for i, rid in enumerate(real_ids)}
    correct, ctx = {}, {}
    for arm, rep in reports.items():
        oof = rep["oof"]
        y = np.asarray(oof["labels"])
        correct[arm] = np.stack([(np.asarray(s) > 0) == y for s in oof["scores"].values()])  # [D, n]
        ctx[arm] = np.asarray([ctx_index.get(i.split("@")[0], -1) for i in oof["ids"]])
    rng = np.random.default_rng(seed)
    n_ctx = len(real_ids)
    counts = [np.bincount(rng.integers(0, n_ctx, n_ctx), minlength=n_ctx) for _ in range(n_boot)]  # [B][n_ctx]
    out = {}
    wanted = [("adversarial", "sft"), ("adversarial_plain", "sft"), ("adversarial", "adversarial_plain")]
    wanted += [(a, "warmstart") for a in reports if a != "warmstart"]
    for a, b in wanted:
        if a in reports and b in reports:
            diffs = []
            for c in counts:
                # items of a context not in the held-out list (index -1) keep weight 1
                wa = np.where(ctx[a] >= 0, c[ctx[a]], 1).astype(float)
                wb = np.where(ctx[b] >= 0, c[ctx[b]], 1).astype(float)
                diffs.append(_panel_td(correct[a], wa) - _panel_td(correct[b], wb))
            point = reports[a]["td"] - reports[b]["td"]
            lo, hi = np.percentile(diffs, [2.5, 97.5])
            out[f"{a}-{b}"] = {"td_difference": point, "ci95": [float(lo), float(hi)],
                               "share_of_resamples_a_lower": float(np.mean(np.asarray(diffs) < 0))}
    return out


def plot_study(study: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(study["arms"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    tds = [study["arms"][a]["td"] for a in arms]
    lo = [study["arms"][a]["td"] - study["arms"][a]["td_ci95"][0] for a in arms]
    hi = [study["arms"][a]["td_ci95"][1] - study["arms"][a]["td"] for a in arms]
    ax1.bar(arms, tds, yerr=[lo, hi], capsize=6, color=[f"C{i}" for i in range(len(arms))])
    ax1.set_ylabel("held-out td (panel max), 95% CI")
    ax1.set_title(f"{study['n_contexts']} held-out contexts per arm")
    for i, a in enumerate(arms):
        curve = study["arms"][a].get("curve") or []
        if not curve:
            continue
        key = "reward" if "reward" in curve[0] else "loss"
        ax2.plot([c["step"] for c in curve], [c[key] for c in curve], label=f"{a} ({key})", color=f"C{i}")
    ax2.set_xlabel("generator step")
    ax2.set_title("training curves")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@friendly_errors
def main(argv=None) -> int:
    from adversary.stages import prepare_data, warm_start
    from adversary.train import quiet_libraries
    from conversations.config import to_jsonable
    from conversations.loaders import write_jsonl
    from discriminator.turing import measure_td
    from generator.diagnostics import realism_diagnostics

    cfg, args, study = parse(argv)
    quiet_libraries()
    t_start = time.time()
    out = Path(args.output_dir)
    (out / "arms").mkdir(parents=True, exist_ok=True)
    cfg.heldout_contexts = study.study_contexts
    args.save_strategy = "no"
    data = prepare_data(cfg, args.seed)
    print(f"study: {len(data.heldout)} held-out contexts, arms {study.arms}, {args.max_steps} generator steps each", flush=True)

    start_model = warm_start(cfg, args, data)
    results = {}
    if study.score_warmstart:
        results["warmstart"] = {"steps": cfg.warmstart_steps, "model_dir": start_model, "wall_seconds": 0.0, "curve": []}
    for arm in study.arms:
        arm_out = out / "runs" / arm
        arm_args = copy.deepcopy(args)
        arm_args.output_dir = str(arm_out)
        print(f"arm {arm}: training", flush=True)
        if arm == "sft":
            results[arm] = run_sft_arm(cfg, arm_args, data, start_model, arm_out)
        else:
            arm_cfg = copy.deepcopy(cfg)
            if arm == "adversarial_plain":
                arm_cfg.w_length = arm_cfg.w_copy = arm_cfg.w_assistant = 0.0
            results[arm] = run_adversarial_arm(arm_cfg, arm_args, data, start_model, arm_out)
        print(f"arm {arm}: {results[arm]['steps']} steps in {results[arm]['wall_seconds']:.0f}s", flush=True)

    write_jsonl(out / "real.jsonl", data.heldout)
    reports, summary = {}, {}
    for arm, res in results.items():
        t0 = time.time()
        sims = simulate_arm(res["model_dir"], data, cfg, args)
        write_jsonl(out / "arms" / f"{arm}.jsonl", sims)
        rep = measure_td(data.heldout, sims, detectors=tuple(study.study_detectors), folds=study.study_folds,
                         seed=args.seed, n_boot=study.n_boot, return_scores=True)
        reports[arm] = rep
        summary[arm] = {
            "td": rep["td"], "td_ci95": rep["td_ci95"], "signed": rep["signed"],
            "auc": rep["auc"], "paired_accuracy": rep["paired_accuracy"], "headline_detector": rep["headline_detector"],
            "detectors": {k: {kk: v[kk] for kk in ("td", "td_ci95", "auc")}
                          for k, v in rep["detectors"].items()},
            "diagnostics": realism_diagnostics(sims, data.heldout),
            "steps": res["steps"], "train_wall_seconds": round(res["wall_seconds"], 1),
            "score_wall_seconds": round(time.time() - t0, 1), "curve": res["curve"],
        }
        print(f"arm {arm}: td {rep['td']:.1f} (95% CI {rep['td_ci95'][0]:.1f}-"
              f"{rep['td_ci95'][1]:.1f}), headline {rep['headline_detector']}", flush=True)
    diffs = paired_differences(reports, [r.id for r in data.heldout], study.n_boot, args.seed)
    doc = {"n_contexts": len(data.heldout), "arms": summary, "differences": diffs,
           "wall_seconds": round(time.time() - t_start, 1), "config": {"adversary": to_jsonable(cfg),
           "grpo": to_jsonable(args), "study": to_jsonable(study)}}
    (out / "study.json").write_text(json.dumps(doc, indent=2, default=float))
    plot_study(doc, out / "study.png")
    for k, d in diffs.items():
        print(f"td difference {k}: {d['td_difference']:+.1f} (95% CI {d['ci95'][0]:+.1f} to {d['ci95'][1]:+.1f})")
    print(f"study done in {doc['wall_seconds'] / 60:.1f} min: {out / 'study.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
