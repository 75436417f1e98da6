"""The go/no-go of issue #26: does the discriminator's signal reach fresh detectors at all?

    python -m adversary.guided --config configs/guided.yaml --out runs/guided

1. A warm start (SFT on real user turns, `warmstart_steps`), cached in OUT/warmstart.
2. The sampling temperature of K=1, chosen on validation contexts by the fast panel (the test split is not looked at).
3. The discriminator (`disc_weights`: the main job's ensemble or one member), fitted on real turns against the warm
   start's turns at that temperature for `disc_init_items` train contexts, less a `calib_fraction` of them (whole
   conversations) on which its log-odds are Platt-scaled; ECE and log-loss before and after, on those held-back pairs.
4. For each fresh sampling seed (`guided_seeds`, none of them the meter's or the validation seed): K_max candidates
   per test context in one pool (OUT/pool_<seed>.jsonl), scored by the calibrated discriminator.
5. Conditions: K=1 (the pool's first candidate), and for every K in `ks` and rule in `rules` the kept candidate of the
   first K (`adversary.guidance.choose`). Each condition and seed is scored by fresh detectors (`guided_detectors`,
   cross-fitted on the test contexts, the same folds everywhere); the difference to K=1 is paired over contexts and
   pooled over seeds (one bootstrap resample of contexts shared by every seed).

Writes OUT/guided.json (resumable: the warm start, the discriminator and each pool are reused when present).
"""

from __future__ import annotations

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

if TYPE_CHECKING:
    from adversary.config import AdversaryConfig


@dataclass
class GuidedConfig:
    ks: list[int] = field(default_factory=lambda: [1, 4, 8, 16], metadata={
        "help": "Candidates per context; 1 is the unguided baseline and must be in the list."})
    rules: list[str] = field(default_factory=lambda: ["resample", "argmax"], metadata={
        "help": "How one of K candidates is kept: resample (by D/(1-D)) and/or argmax (best-of-K)."})
    guided_seeds: list[int] = field(default_factory=lambda: [2001, 2002, 2003], metadata={
        "help": "Fresh sampling seeds: a pool of candidates and a resampling draw each."})
    test_contexts: int = field(default=1200, metadata={"help": "Test-split contexts scored per condition and seed."})
    val_contexts: int = field(default=300, metadata={"help": "Validation contexts for the temperature choice."})
    temperatures: list[float] = field(default_factory=lambda: [0.9, 1.0], metadata={
        "help": "Temperatures K=1 chooses from on validation contexts (one value: no choice)."})
    calib_fraction: float = field(default=0.25, metadata={
        "help": "Share of the discriminator's fit contexts held back (by conversation) to calibrate it on."})
    guided_detectors: list[str] = field(default_factory=lambda: ["classical", "style", "embed"], metadata={
        "help": "Fresh detectors of the scoring (embed: frozen MiniLM + a logistic head)."})
    guided_folds: int = field(default=5, metadata={"help": "Cross-fitting folds of the scoring."})
    n_boot: int = field(default=1000, metadata={"help": "Bootstrap resamples of the paired differences."})
    share_pool: bool = field(default=False, metadata={
        "help": "One pool of K_max candidates (the first seed's) for every seed, each seed reading its own window of "
                "it: K=1 and small K on disjoint candidates (fresh samples), K=K_max on the same ones with a fresh "
                "resampling draw. A third of the sampling cost (a K_max=16 pool of 1,200 contexts took ~30 min here); "
                "false: a fresh pool per seed."})
    disc_tag: str = field(default="", metadata={
        "help": "Name of this discriminator variant: its fit goes to OUT/disc_<tag> and its results to "
                "OUT/guided_<tag>.json, so variants share the warm start and the candidate pools (empty: OUT/disc, "
                "OUT/guided.json)."})

    def __post_init__(self):
        if 1 not in self.ks or min(self.ks) < 1:
            raise ConfigError(f"ks: give candidate counts >= 1 including 1 (the baseline), got {self.ks}")
        from adversary.guidance import RULES

        bad = [r for r in self.rules if r not in RULES]
        if bad or not self.rules:
            raise ConfigError(f"rules: choose from {', '.join(RULES)}, got {self.rules}")
        if not self.guided_seeds:
            raise ConfigError("guided_seeds: give at least one seed")
        if not 0.05 <= self.calib_fraction <= 0.5:
            raise ConfigError(f"calib_fraction must be in [0.05, 0.5], got {self.calib_fraction}")
        if self.test_contexts < 20 or self.val_contexts < 20:
            raise ConfigError("test_contexts and val_contexts must be >= 20")


def pooled_difference(correct_a: list[np.ndarray], correct_b: list[np.ndarray], ctx: list[np.ndarray],
                      counts: np.ndarray) -> np.ndarray:
    """Bootstrap distribution [B] of mean over seeds of (panel td of a - panel td of b), both read on the same
    items (`discriminator.turing.pooled_panel_td`)."""
    from conversations.bootstrap import pooled_panel_td

    return pooled_panel_td(correct_a, ctx, counts) - pooled_panel_td(correct_b, ctx, counts)


def candidate_window(i: int, n_seeds: int, k: int, k_max: int) -> range:
    """The candidates seed i reads at K=k from a shared pool of k_max: windows spread evenly over the pool, so that
    with 3 seeds K=1 reads candidates 0 / 8 / 15 and K=4 reads 0-3 / 6-9 / 12-15 of 16 (disjoint), K=8 halves that
    overlap, and K=k_max the whole pool."""
    start = 0 if n_seeds < 2 else round(i * (k_max - k) / (n_seeds - 1))
    return range(start, start + k)


def _load_or_fit_discriminator(cfg: AdversaryConfig, args, guided, data, engine, settings, out: Path):
    from adversary.guidance import fit_guide
    from adversary.stages import make_discriminator
    from discriminator.calibration import PlattScaler
    from generator.sample import simulate_records

    ddir = out / (f"disc_{guided.disc_tag}" if guided.disc_tag else "disc")
    scaler = PlattScaler()
    if (ddir / "calibration.json").exists():
        from adversary.discriminator import Discriminator

        doc = json.loads((ddir / "calibration.json").read_text())
        scaler.a, scaler.b = doc["platt"]["a"], doc["platt"]["b"]
        return Discriminator.from_saved(ddir), scaler, doc
    t0 = time.time()
    sims = simulate_records(engine, data.disc_fit, settings, seed=seed_for("fit_samples", args.seed))
    guide = fit_guide(make_discriminator(cfg, args.seed), data.disc_fit, sims, guided.calib_fraction,
                      epochs=cfg.disc_epochs)
    doc = {**guide.report, "seconds": round(time.time() - t0, 1)}  # the simulation included
    scaler.a, scaler.b = guide.platt
    guide.disc.save(ddir)
    (ddir / "calibration.json").write_text(json.dumps(doc, indent=2))
    return guide.disc, scaler, doc


def _pool(engine, data, settings, k_max: int, seed: int, out: Path):
    from conversations.loaders import write_jsonl
    from conversations.schema import TurnRecord
    from generator.sample import simulate_candidates

    path, meta = out / f"pool_{seed}.jsonl", out / f"pool_{seed}.json"
    if path.exists() and meta.exists():
        with open(path, encoding="utf-8") as f:
            flat = [TurnRecord.from_dict(json.loads(line)) for line in f]
        return [flat[i * k_max:(i + 1) * k_max] for i in range(len(flat) // k_max)], json.loads(meta.read_text())
    t0 = time.time()
    pool = simulate_candidates(engine, data.heldout, settings, k_max, seed=seed)
    seconds = time.time() - t0
    write_jsonl(path, [c for cs in pool for c in cs])
    doc = {"seconds": round(seconds, 1), "candidates": len(pool) * k_max}
    meta.write_text(json.dumps(doc))
    return pool, doc


@friendly_errors
def main(argv=None) -> int:
    from adversary.config import parse_job
    from adversary.config import resolved as resolved_config
    from adversary.guidance import choose, effective_sample_size
    from adversary.heldout import HELDOUT_SEED, heldout_settings, simulate_heldout
    from adversary.stages import prepare_data, warm_start
    from conversations.cli_util import quiet_libraries
    from conversations.bootstrap import percentile_ci, resample_counts
    from conversations.config import to_jsonable
    from conversations.precision import inference_dtype
    from discriminator.turing import measure_td
    from generator.diagnostics import jsonable, realism_diagnostics
    from generator.engine import Engine
    from generator.model import load_generator

    quiet_libraries()
    argv = ["--output_dir" if a == "--out" else a for a in (sys.argv[1:] if argv is None else argv)]
    cfg, args, guided = parse_job((GuidedConfig,), argv, prog="python -m adversary.guided")
    from conversations.cli_util import start_process

    start_process()
    t_start = time.time()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg.heldout_contexts = guided.test_contexts
    data = prepare_data(cfg, args.seed, val_contexts=guided.val_contexts)
    timings = {}
    t0 = time.time()
    start = warm_start(cfg, args, data)
    timings["warm_start"] = round(time.time() - t0, 1)
    model, tok = load_generator(start, trust_remote_code=args.trust_remote_code, dtype=inference_dtype(cfg.dtype))
    engine = Engine(model, tok, batch_size=cfg.sim_batch_size, precision=cfg.dtype)

    tpath = out / "temperature.json"
    if tpath.exists():
        temp_doc = json.loads(tpath.read_text())
    else:
        tds = {}
        for t in guided.temperatures:
            sims = simulate_heldout(model, tok, data.val, cfg, precision=cfg.dtype, settings=heldout_settings(cfg, t))
            tds[str(t)] = measure_td(data.val, sims, detectors=("classical", "style"), folds=guided.guided_folds,
                                     seed=args.seed, n_boot=200)["td"]
        best = min(tds, key=lambda t: (round(tds[t], 6), abs(float(t) - 1.0)))
        temp_doc = {"temperature": float(best), "val_td_by_temperature": tds, "seed": HELDOUT_SEED}
        tpath.write_text(json.dumps(temp_doc, indent=2))
    settings = heldout_settings(cfg, temp_doc["temperature"])
    print(f"guided: T={settings.temperature} (validation td {temp_doc['val_td_by_temperature']})", flush=True)

    t0 = time.time()
    disc, scaler, disc_doc = _load_or_fit_discriminator(cfg, args, guided, data, engine, settings, out)
    timings["discriminator"] = round(time.time() - t0, 1)
    cal = disc_doc["heldback"]
    print(f"discriminator {disc_doc['members']}: fit on {disc_doc['fit_items']} turns (train acc "
          f"{disc_doc['train_accuracy']:.3f}); held-back pairs: acc {cal['raw']['accuracy']:.3f}, ECE "
          f"{cal['raw']['ece']:.3f} -> {cal['calibrated']['ece']:.3f} after Platt", flush=True)

    k_max = max(guided.ks)
    conditions = ["K1"] + [f"{r}_K{k}" for k in sorted(guided.ks) if k > 1 for r in guided.rules]
    real = list(data.heldout)
    ctx_of = {r.id: i for i, r in enumerate(real)}
    per_seed: dict[str, list[dict]] = {c: [] for c in conditions}
    correct: dict[str, list[np.ndarray]] = {c: [] for c in conditions}
    ctx_idx: dict[str, list[np.ndarray]] = {c: [] for c in conditions}
    pool_seconds = {}
    pool = z = None
    for si, seed in enumerate(guided.guided_seeds):
        if pool is None or not guided.share_pool:
            pool_seed = guided.guided_seeds[0] if guided.share_pool else seed
            pool, pool_doc = _pool(engine, data, settings, k_max, pool_seed, out)
            pool_seconds[str(pool_seed)] = pool_doc["seconds"]
            print(f"seed {pool_seed}: {len(pool)} x {k_max} candidates in {pool_doc['seconds']:.0f}s", flush=True)
            flat = [c for cs in pool for c in cs]
            z = scaler(disc.score([c if c.user_turn.strip() else type(c)(id=c.id, context=c.context, user_turn="...")
                                   for c in flat])).reshape(len(pool), k_max)  # (n_ctx, K_max) calibrated log-odds
        rng = np.random.default_rng(seed)
        for cond in conditions:
            k = 1 if cond == "K1" else int(cond.rsplit("_K", 1)[1])
            window = np.asarray(candidate_window(si, len(guided.guided_seeds), k, k_max) if guided.share_pool
                                else range(k))
            if cond == "K1":
                pick = np.full(len(pool), window[0], dtype=np.int64)
            else:
                pick = window[choose(z[:, window], cond.rsplit("_K", 1)[0], rng)]
            chosen = [pool[i][j] for i, j in enumerate(pick)]
            rep = measure_td(real, chosen, detectors=tuple(guided.guided_detectors), folds=guided.guided_folds,
                             seed=args.seed, n_boot=200, return_scores=True)
            oof = rep.pop("oof")
            yy = np.asarray(oof["labels"])
            correct[cond].append(np.stack([(np.asarray(s) > 0) == yy for s in oof["scores"].values()]))
            ctx_idx[cond].append(np.asarray([ctx_of[i] for i in oof["ids"]]))
            row = {"seed": seed, "td": rep["td"], "td_ci95": rep["td_ci95"], "auc": rep["auc"],
                   "log_loss": rep["log_loss"], "headline": rep["headline_detector"],
                   "detectors": {d: {kk: v[kk] for kk in ("td", "auc", "log_loss", "accuracy")}
                                 for d, v in rep["detectors"].items()},
                   "disc_logodds_kept": float(np.mean(z[np.arange(len(pool)), pick])),
                   "ess": float(np.mean(effective_sample_size(z[:, window]))), "candidates": [int(window[0]), int(window[-1])],
                   "diagnostics": jsonable(realism_diagnostics(chosen, real))}
            per_seed[cond].append(row)
            each = ", ".join(f"{d} {v['td']:.1f}" for d, v in row["detectors"].items())
            print(f"seed {seed} {cond}: td {rep['td']:.1f}, auc {rep['auc']:.3f}, log-loss {rep['log_loss']:.3f} "
                  f"({each}); D kept "
                  f"{row['disc_logodds_kept']:+.2f}", flush=True)

    counts = resample_counts(len(real), guided.n_boot, args.seed)
    summary = {}
    for cond in conditions:
        rows = per_seed[cond]
        s = {"td": float(np.mean([r["td"] for r in rows])), "td_sd": float(np.std([r["td"] for r in rows], ddof=1))
             if len(rows) > 1 else 0.0, "auc": float(np.mean([r["auc"] for r in rows])),
             "log_loss": float(np.mean([r["log_loss"] for r in rows])),
             "detectors": {d: {m: float(np.mean([r["detectors"][d][m] for r in rows])) for m in ("td", "auc", "log_loss")}
                           for d in rows[0]["detectors"]},
             "disc_logodds_kept": float(np.mean([r["disc_logodds_kept"] for r in rows])),
             "ess": float(np.mean([r["ess"] for r in rows]))}
        if cond != "K1":
            boot = pooled_difference(correct[cond], correct["K1"], ctx_idx[cond], counts)
            lo, hi = percentile_ci(boot)
            s["vs_K1"] = {"td_difference": s["td"] - summary["K1"]["td"], "ci95": [float(lo), float(hi)],
                          "auc_difference": s["auc"] - summary["K1"]["auc"],
                          "share_lower": float(np.mean(boot < 0))}
        summary[cond] = s
        extra = (f", vs K1 {s['vs_K1']['td_difference']:+.1f} (95% CI {s['vs_K1']['ci95'][0]:+.1f} to "
                 f"{s['vs_K1']['ci95'][1]:+.1f})" if cond != "K1" else "")
        print(f"{cond}: td {s['td']:.1f} (sd {s['td_sd']:.1f} over seeds), auc {s['auc']:.3f}{extra}", flush=True)
    doc = {"n_contexts": len(real), "seeds": guided.guided_seeds, "temperature": temp_doc, "discriminator": disc_doc,
           "conditions": summary, "per_seed": per_seed, "pool_seconds": pool_seconds, "timings": timings,
           "wall_seconds": round(time.time() - t_start, 1),
           "config": {"adversary": resolved_config(cfg), "guided": to_jsonable(guided)}}
    result = out / (f"guided_{guided.disc_tag}.json" if guided.disc_tag else "guided.json")
    result.write_text(json.dumps(doc, indent=2, default=float))
    print(f"guided done in {doc['wall_seconds'] / 60:.1f} min: {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
