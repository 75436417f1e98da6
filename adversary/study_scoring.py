"""The study's scoring: each arm at the temperature it chose on validation contexts, one turn per test context for
every fresh seed, scored by the fresh panel (and, with `study_conversations`, whole conversations); the paired
differences between arms pool the seeds (contexts resampled jointly for every arm and seed). Every arm's scoring is
cached under OUT/arms, so an interrupted study scores only what it has not."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from adversary.config import AdversaryConfig, ModelArgs


def load_arm(model_dir: str, cfg: ModelArgs, args):
    from conversations.precision import inference_dtype
    from generator.model import load_generator

    return load_generator(model_dir, trust_remote_code=args.trust_remote_code, dtype=inference_dtype(cfg.dtype))


def load_guide(res: dict):
    """The arm's guide (`adversary.guidance.Guide`) when it has one, else None."""
    if not res.get("guide"):
        return None
    from adversary.guidance import Guide

    return Guide.load(res["guide"]["dir"])


def simulate_arm(model, tok, records, cfg: AdversaryConfig, settings, seed: int, guide=None) -> tuple[list, dict]:
    """One turn per context: sampled (no guide, or K = 1), or kept by the arm's guide from K candidates drawn from
    one prefill (`adversary.guidance`). -> (turns, {"guide_ess": mean Kish ESS of the weights, "guide_logodds_kept":
    mean calibrated log-odds of the kept turns}; empty without a guide)."""
    from adversary.guidance import effective_sample_size, guided_records
    from adversary.heldout import HELDOUT_SEED, simulate_heldout
    from generator.engine import Engine

    if guide is None or guide.k == 1:
        return simulate_heldout(model, tok, records, cfg, seed=seed, precision=cfg.dtype, settings=settings), {}
    engine = Engine(model, tok, batch_size=cfg.sim_batch_size, precision=cfg.dtype)
    kept, z, pick = guided_records(engine, guide, records, settings, seed=seed, pick_seed=seed + HELDOUT_SEED)
    return kept, {"guide_ess": float(np.mean(effective_sample_size(z))),
                  "guide_logodds_kept": float(np.mean(z[np.arange(len(kept)), pick])),
                  "guide_logodds_mean": float(np.mean(z))}


def choose_temperature(model, tok, cfg: AdversaryConfig, study, data, seed: int, guide=None) -> tuple[float, dict]:
    """The temperature with the lowest fast-panel td on the validation contexts (ties: the one nearest 1); a guided
    arm chooses with its guide on."""
    from adversary.heldout import HELDOUT_SEED, heldout_settings
    from discriminator.turing import measure_td

    if len(study.temperatures) == 1:  # nothing to choose: no validation reading
        return study.temperatures[0], {}
    tds = {}
    for t in study.temperatures:
        sims, _ = simulate_arm(model, tok, data.val, cfg, heldout_settings(cfg, t), HELDOUT_SEED, guide)
        tds[t] = measure_td(data.val, sims, detectors=("classical", "style"), folds=study.study_folds, seed=seed,
                            n_boot=200)["td"]
    best = min(tds, key=lambda t: (round(tds[t], 6), abs(t - 1.0)))
    return best, tds


def _panel_td(correct: np.ndarray, weights: np.ndarray) -> float:
    """Panel td on a weighted resample: per detector accuracy, then the maximum |acc - 50|."""
    acc = 100.0 * (correct * weights[None, :]).sum(1) / weights.sum()
    return float(np.max(np.abs(acc - 50.0)))


def _correct_and_contexts(oofs, ctx_index: dict) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per seed: (D, n) booleans (detector right on item) and (n,) the item's context index."""
    correct, ctx = [], []
    for oof in oofs if isinstance(oofs, list) else [oofs]:
        y = np.asarray(oof["labels"])
        correct.append(np.stack([(np.asarray(v) > 0) == y for v in oof["scores"].values()]))
        ctx.append(np.asarray([ctx_index[i.split("@")[0]] for i in oof["ids"]]))
    return correct, ctx


def pooled_td_ci(oofs, real_ids: list[str], n_boot: int, seed: int) -> list[float]:
    """95% CI of a td that is the mean over sampling seeds: held-out contexts resampled jointly for every seed.
    `oofs`: one out-of-fold record per seed; `real_ids`: the contexts (resampling units)."""
    from conversations.bootstrap import percentile_ci, pooled_panel_td, resample_counts

    ctx_index = {rid: i for i, rid in enumerate(real_ids)}
    boot = pooled_panel_td(*_correct_and_contexts(oofs, ctx_index), resample_counts(len(real_ids), n_boot, seed))
    return list(percentile_ci(boot))


def paired_differences(reports: dict, real_ids: list[str], n_boot: int, seed: int) -> dict:
    """td(arm) - td(other) for every pair of arms, each td the mean over its sampling seeds, with a 95% CI from
    resampling held-out contexts jointly (the same resample for every arm and seed). `reports[arm]`: {"td", "oof":
    one out-of-fold record or a list of them, one per seed}. Fewer than two arms: no pair, {}."""
    from conversations.bootstrap import percentile_ci, pooled_panel_td, resample_counts

    if len(reports) < 2:
        return {}
    ctx_index = {rid: i for i, rid in enumerate(real_ids)}
    counts = resample_counts(len(real_ids), n_boot, seed)  # (B, n_ctx): contexts drawn jointly for every arm
    boot = {arm: pooled_panel_td(*_correct_and_contexts(rep["oof"], ctx_index), counts) for arm, rep in reports.items()}
    out = {}
    names = list(reports)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            diffs = boot[a] - boot[b]
            lo, hi = percentile_ci(diffs)
            out[f"{a}-{b}"] = {"td_difference": reports[a]["td"] - reports[b]["td"], "ci95": [float(lo), float(hi)],
                               "share_of_resamples_a_lower": float(np.mean(diffs < 0))}
    return out


def score_arm(arm: str, res: dict, cfg: AdversaryConfig, args, study, data, out: Path) -> tuple[dict, list[dict]]:
    """The arm's temperature chosen on validation contexts, then one turn per test context for every fresh seed of
    `study_seeds`, each seed scored by the panel: (the arm's summary, its out-of-fold records, one per seed). Cached
    in OUT/arms/<arm>.score.json (a rerun of an interrupted study scores only the arms not yet scored); every seed's
    turns in OUT/arms/<arm>.jsonl (the first seed) and <arm>.seed<N>.jsonl (the others), for re-scoring."""
    from adversary.heldout import heldout_settings
    from conversations.loaders import write_jsonl
    from discriminator.turing import measure_td, oof_record
    from generator.diagnostics import jsonable, realism_diagnostics

    cache = out / "arms" / f"{arm}.score.json"
    if cache.exists():
        doc = json.loads(cache.read_text())
        print(f"arm {arm}: reusing its scoring ({cache})", flush=True)
        return doc["summary"], doc["oof"]
    t0 = time.time()
    model, tok = load_arm(res["model_dir"], cfg, args)
    guide = load_guide(res)
    temp, val_tds = choose_temperature(model, tok, cfg, study, data, args.seed, guide)
    per_seed, oofs, first, sim_seconds = [], [], None, 0.0
    for i, seed in enumerate(study.study_seeds):
        t_sim = time.time()
        sims, guide_diag = simulate_arm(model, tok, data.heldout, cfg, heldout_settings(cfg, temp), seed, guide)
        sim_seconds += time.time() - t_sim
        write_jsonl(out / "arms" / (f"{arm}.jsonl" if i == 0 else f"{arm}.seed{seed}.jsonl"), sims)
        rep = measure_td(data.heldout, sims, detectors=tuple(study.study_detectors), folds=study.study_folds,
                         seed=args.seed, n_boot=study.n_boot, return_scores=True)
        oofs.append(oof_record(rep.pop("oof")))
        per_seed.append({"seed": seed, "td": rep["td"], "td_ci95": rep["td_ci95"], "auc": rep["auc"],
                         "log_loss": rep.get("log_loss"), "headline_detector": rep["headline_detector"],
                         "detectors": {d: {k: v.get(k) for k in ("td", "td_ci95", "auc", "log_loss")}
                                       for d, v in rep["detectors"].items()}, **guide_diag})
        first = first or sims
        print(f"arm {arm} seed {seed}: td {rep['td']:.1f} (95% CI {rep['td_ci95'][0]:.1f}-{rep['td_ci95'][1]:.1f}), "
              f"auc {rep['auc']:.3f}, headline {rep['headline_detector']}", flush=True)
    del model
    tds = [r["td"] for r in per_seed]
    mean = lambda key: float(np.mean([r[key] for r in per_seed if r[key] is not None]))  # noqa: E731
    summary = {
        "td": float(np.mean(tds)), "td_ci95": pooled_td_ci(oofs, [r.id for r in data.heldout], study.n_boot, args.seed),
        "td_sd_over_seeds": float(np.std(tds, ddof=1)) if len(tds) > 1 else 0.0, "auc": mean("auc"),
        "log_loss": mean("log_loss"),
        "detectors": {d: {m: float(np.mean([r["detectors"][d][m] for r in per_seed])) for m in ("td", "auc")}
                      for d in per_seed[0]["detectors"]},
        "headline_detector": per_seed[0]["headline_detector"], "per_seed": per_seed,
        "temperature": temp, "val_td_by_temperature": val_tds,
        "diagnostics": jsonable(realism_diagnostics(first, data.heldout)), "steps": res["steps"],
        "train_wall_seconds": round(res["wall_seconds"], 1), "score_wall_seconds": round(time.time() - t0, 1),
        "overrides": res.get("overrides", {}), "curve": res["curve"], "cotrain": res.get("cotrain", []),
        # the test turns' sampling time per kept turn: what a guide's K candidates cost at inference
        "seconds_per_turn": sim_seconds / (len(study.study_seeds) * len(data.heldout)),
        "guide": res.get("guide"),
    }
    cache.write_text(json.dumps({"summary": summary, "oof": oofs}, default=float))
    print(f"arm {arm}: td {summary['td']:.1f} (mean of {len(tds)} seeds, sd {summary['td_sd_over_seeds']:.1f}; 95% CI "
          f"{summary['td_ci95'][0]:.1f}-{summary['td_ci95'][1]:.1f}) at T={temp}", flush=True)
    return summary, oofs


def score_conversations(arm: str, res: dict, cfg: AdversaryConfig, args, study, data, out: Path,
                        temperature: float) -> tuple[dict, list[dict]]:
    """The arm at the conversation level, at its chosen temperature, once per seed: (the mean over seeds of every
    `conv/*` figure and each seed's row, the detectors' out-of-fold records, one per seed, for the paired
    differences). Cached in OUT/arms/<arm>.conv.json; a cache written before it kept those records is scored again."""
    import copy as _copy

    from adversary.conversation_meter import (calibrated_end_bias, measure_conversations,
                                              simulate_heldout_conversations)
    from adversary.heldout import heldout_settings

    cache = out / "arms" / f"{arm}.conv.json"
    if cache.exists():
        doc = json.loads(cache.read_text())
        if "oof" in doc:
            return doc, doc.pop("oof")
    t0 = time.time()
    model, tok = load_arm(res["model_dir"], cfg, args)
    guide = load_guide(res)
    panel = _copy.copy(cfg)
    panel.heldout_detectors, panel.heldout_folds = list(study.study_detectors), study.study_folds
    settings, end_bias = heldout_settings(cfg, temperature), None
    # end_decision calibrated: the offset solved once per arm on its own (unguided) turns (the meter: per reading)
    if data.end_contexts:
        end_bias = calibrated_end_bias(model, tok, data.end_contexts, cfg, settings, data.real_end_rate,
                                       study.study_seeds[0], precision=cfg.dtype)
        settings = settings.replace(end_bias=end_bias)
    rows, oofs = [], []
    for seed in study.study_seeds:
        sims = simulate_heldout_conversations(model, tok, data.heldout_convs, cfg, settings, seed, precision=cfg.dtype,
                                              guide=guide)
        row = measure_conversations(data.heldout_convs, sims, panel, seed=args.seed, return_scores=True)
        oofs.append(row.pop("oof"))
        rows.append({"seed": seed, **row})
    del model
    keys = [k for k in rows[0] if k.startswith("conv/")]
    doc = {**{k: float(np.nanmean([r[k] for r in rows])) for k in keys},
           "conv/td_sd_over_seeds": float(np.std([r["conv/td"] for r in rows], ddof=1)) if len(rows) > 1 else 0.0,
           "per_seed": rows, "seconds": round(time.time() - t0, 1), "guide_k": guide.k if guide is not None else 1,
           "end_bias": end_bias}
    cache.write_text(json.dumps({**doc, "oof": oofs}, default=float))
    print(f"arm {arm}: conversation td {doc['conv/td']:.1f}, termination F1 {doc['conv/termination_f1']:.2f}, "
          f"ends/real {doc['conv/ends_per_real']:.2f} ({len(data.heldout_convs)} conversations x {len(rows)} seeds)",
          flush=True)
    return doc, oofs
