"""Is the language-model judge stronger than the co-trained ensemble? Both read on the same fresh held-out pairs.

    python -m adversary.judge_study --train-real R --train-sim S --test-real R2 --test-sim S2 --out OUT \
        [--pairs 2000] [--readings 250 500 1000 2000] [--ensemble-items 128] [--judge J]

R/S: real turns and the warm start's own turns for the same TRAIN contexts (turn records; a simulated id is the real
id plus "@..."; `generator.simulate --real_out` writes both). R2/S2: the same for TEST contexts, which neither judge
sees while it learns. The judges:
- `lmjudge`: `discriminator.lm_judge.LMJudge` (SmolLM2-135M + its own LoRA and head, Bradley-Terry on the pairs),
  read on the test pairs after each of `readings` train pairs (its learning curve), then calibrated; with `--judge J`
  a judge an earlier run fitted on these pairs (J = that run's OUT/lmjudge) is read instead of fitted again;
- `ngram/same`: the char/word n-gram classifier (`discriminator.classical`) fitted on the same pairs;
- `judge+ngram`: the two above averaged in log-odds (the main job's discriminator with `disc_family: lmjudge` and
  `disc_weights: [1, 1]`), from the members' own test scores;
- `ensemble/demo`: the main job's discriminator as `make demo` fits it (MiniLM + char n-grams, `ensemble_items`
  real and simulated turns, 2 epochs);
- `ensemble/same`: the same ensemble fitted on the judge's `pairs` pairs (what more data alone buys it).
Each: paired accuracy (the share of test pairs where the real turn scores higher), pointwise accuracy, AUC, fit
seconds. OUT/judge_study.json is rewritten after every part; a part already in it is not run again (resume).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conversations import DataError, read_items
from conversations.cli_util import friendly_errors


def pairs_of(real_path: str, sim_path: str, limit: int | None = None):
    """(real, sim) turn records of the same contexts, in the real file's order, at most `limit`."""
    real, sims = read_items(real_path), read_items(sim_path)
    by_id = {s.id.split("@")[0]: s for s in sims}
    out = [(r, by_id[r.id]) for r in real if r.id in by_id]
    if not out:
        raise DataError("no simulated turn shares an id with a real one (the same contexts)", sim_path)
    return [p[0] for p in out][:limit], [p[1] for p in out][:limit]


def reading(det, real, sim) -> dict:
    """`det` read on the test pairs: one scoring pass over the real turns, then their simulated partners."""
    return reading_of_scores(np.asarray(det.score([*real, *sim]), dtype=np.float64), len(real))


def reading_of_scores(s: np.ndarray, n: int) -> dict:
    """Every figure of a reading from its scores [2n]: the n real turns, then their n simulated partners."""
    from discriminator.turing import accuracy, roc_auc

    y = np.array([1] * n + [0] * n)
    d = s[:n] - s[n:]
    return {"paired_accuracy": 100.0 * float(np.mean((d > 0) + 0.5 * (d == 0))), "accuracy": accuracy(s, y),
            "auc": roc_auc(s, y), "n_pairs": n, "pair_log_odds_mean": float(d.mean()),
            "paired_correct": [bool(x) for x in d > 0], "scores": [round(float(x), 5) for x in s]}


def build_parser():
    p = argparse.ArgumentParser(prog="python -m adversary.judge_study", description=__doc__.split("\n")[0])
    p.add_argument("--train-real", required=True)
    p.add_argument("--train-sim", required=True)
    p.add_argument("--test-real", required=True)
    p.add_argument("--test-sim", required=True)
    p.add_argument("--out", required=True, help="folder: judge_study.json and the judge's weights")
    p.add_argument("--pairs", type=int, default=2000, help="train pairs the judge learns from")
    p.add_argument("--readings", type=int, nargs="+", default=[250, 500, 1000, 2000],
                   help="train pairs after which the judge is read on the test pairs")
    p.add_argument("--test-pairs", type=int, default=800)
    p.add_argument("--ensemble-items", type=int, default=128, help="the demo ensemble's real (and simulated) turns")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--judge", default="", help="a judge an earlier run fitted on these train pairs: read, not fitted")
    p.add_argument("--skip", nargs="*", default=[], choices=["lmjudge", "ngram/same", "ensemble/demo", "ensemble/same"])
    return p


@friendly_errors
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from conversations.cli_util import start_process

    start_process()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "judge_study.json"
    doc = json.loads(path.read_text()) if path.exists() else {"parts": {}}
    doc.update({"args": vars(args), "date": time.strftime("%Y-%m-%d")})

    def save():
        path.write_text(json.dumps(doc, indent=2) + "\n")

    tr_real, tr_sim = pairs_of(args.train_real, args.train_sim, args.pairs)
    te_real, te_sim = pairs_of(args.test_real, args.test_sim, args.test_pairs)
    doc["n_train_pairs"], doc["n_test_pairs"] = len(tr_real), len(te_real)
    print(f"{len(tr_real)} train pairs, {len(te_real)} test pairs", flush=True)
    parts = doc["parts"]

    if "lmjudge" not in parts and "lmjudge" not in args.skip and args.judge:
        from discriminator.lm_judge import LMJudge

        judge = LMJudge.load(args.judge)
        prior = Path(args.judge).parent / "judge_study.json"  # the run that fitted it, for its fit seconds
        fitted = json.loads(prior.read_text())["parts"].get("lmjudge", {}) if prior.exists() else {}
        parts["lmjudge"] = {**reading(judge, te_real, te_sim), "loaded_from": str(args.judge),
                            "curve": fitted.get("curve", []), "fit_seconds": fitted.get("fit_seconds"),
                            "config": judge.config()}
        save()
    if "lmjudge" not in parts and "lmjudge" not in args.skip:
        from discriminator.lm_judge import LMJudge

        t0 = time.perf_counter()
        judge = LMJudge(seed=args.seed)
        curve, done, fit_s = [], 0, 0.0
        for upto in sorted(set(min(r, len(tr_real)) for r in args.readings)):
            chunk_r, chunk_s = tr_real[done:upto], tr_sim[done:upto]
            t1 = time.perf_counter()
            judge.fit([*chunk_r, *chunk_s], [1] * len(chunk_r) + [0] * len(chunk_s), calibrate=False)
            fit_s += time.perf_counter() - t1
            done = upto
            r = reading(judge, te_real, te_sim)
            curve.append({"train_pairs": done, "paired_accuracy": r["paired_accuracy"], "auc": r["auc"],
                          "fit_seconds": round(fit_s, 1)})
            print(f"lmjudge after {done} pairs: paired {r['paired_accuracy']:.1f}, AUC {r['auc']:.3f} "
                  f"({fit_s:.0f} s of fitting)", flush=True)
        judge.calibrate([*tr_real, *tr_sim], [1] * len(tr_real) + [0] * len(tr_sim))
        r = reading(judge, te_real, te_sim)
        judge.save(out / "lmjudge")
        parts["lmjudge"] = {**r, "curve": curve, "fit_seconds": round(fit_s, 1),
                            "seconds": round(time.perf_counter() - t0, 1), "config": judge.config()}
        save()

    if "ngram/same" not in parts and "ngram/same" not in args.skip:
        from discriminator.classical import ClassicalDetector

        t0 = time.perf_counter()
        ngram = ClassicalDetector(seed=args.seed).fit([*tr_real, *tr_sim], np.array([1] * len(tr_real) + [0] * len(tr_sim)))
        parts["ngram/same"] = {**reading(ngram, te_real, te_sim), "train_pairs": len(tr_real),
                               "fit_seconds": round(time.perf_counter() - t0, 1)}
        save()
    if "lmjudge" in parts and "ngram/same" in parts:
        from discriminator.turing import JUDGE_NGRAM

        # the Discriminator's weighted mean of log-odds with weights (1, 1), from the members' scores
        s = (np.array(parts["lmjudge"]["scores"]) + np.array(parts["ngram/same"]["scores"])) / 2
        parts[JUDGE_NGRAM] = {**reading_of_scores(s, len(te_real)), "train_pairs": len(tr_real),
                                "fit_seconds": (parts["lmjudge"]["fit_seconds"] or 0) + parts["ngram/same"]["fit_seconds"]}
        save()

    from adversary.discriminator import Discriminator
    from discriminator.neural import NeuralDetector

    for name, n in (("ensemble/demo", args.ensemble_items), ("ensemble/same", len(tr_real))):
        if name in parts or name in args.skip:
            continue
        t0 = time.perf_counter()
        # the demo's discriminator settings (configs/demo.yaml): MiniLM, 160 tokens, 64 of context, 2 epochs
        neural = NeuralDetector(backbone="minilm-l6", max_length=160, context_tokens=64, lr=3e-5, batch_size=16,
                                label_smoothing=0.1, seed=args.seed)
        disc = Discriminator(neural, classical=True, weights=(1.0, 1.0), seed=args.seed)
        disc.fit([*tr_real[:n], *tr_sim[:n]], np.array([1] * n + [0] * n), epochs=2)
        fit_s = time.perf_counter() - t0
        parts[name] = {**reading(disc, te_real, te_sim), "train_pairs": n, "fit_seconds": round(fit_s, 1)}
        for member, det in (("neural", disc.neural), ("classical", disc.classical)):
            parts[name][f"member/{member}"] = {k: v for k, v in reading(det, te_real, te_sim).items()
                                               if k not in ("paired_correct", "scores")}
        print(f"{name} ({n} pairs): paired {parts[name]['paired_accuracy']:.1f}, AUC {parts[name]['auc']:.3f}",
              flush=True)
        save()

    from discriminator.turing import bootstrap_accuracies

    for a_name, b_name in (("lmjudge", "ensemble/demo"), ("lmjudge", "ensemble/same"), ("lmjudge", "ngram/same"),
                           ("judge+ngram", "ensemble/same"), ("judge+ngram", "ensemble/demo")):
        if a_name in parts and b_name in parts:  # paired over the same test pairs, on the same resamples
            a = np.array(parts[a_name]["paired_correct"], dtype=float)
            b = np.array(parts[b_name]["paired_correct"], dtype=float)
            diffs = bootstrap_accuracies(np.stack([a, b]), None, 2000, args.seed)  # (n_boot, 2)
            d = diffs[:, 0] - diffs[:, 1]
            doc[f"{a_name}_minus_{b_name}".replace("/", "_").replace("+", "_")] = {
                "value": float(100 * (a.mean() - b.mean())),
                "ci95": [float(np.percentile(d, 2.5)), float(np.percentile(d, 97.5))]}
    save()
    for k, v in parts.items():
        print(f"{k:<14} paired {v['paired_accuracy']:.1f}  pointwise {v['accuracy']:.1f}  AUC {v['auc']:.3f}  "
              f"fit {v.get('fit_seconds')} s")
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
