"""How much the simulator knows about where a real user stops: p_end (generator.ending) on real held-out turns.

On the test split's real user turns after the opening (the turns the conversation meter judges), teacher-forced:
the AUC of p_end for "this is the conversation's last user turn", its mean against the real rate (calibration), the
F1 of the best threshold and of the threshold that matches the real rate, and the expected F1 of Bernoulli draws at
p_end (what sampling the decision gives). Prints one JSON object.

    python bench/bench_end_decision.py --model runs/demo/warmstart/merged --turns 600
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def f1_at(pred, y) -> float:
    tp = sum(p and t for p, t in zip(pred, y))
    fp = sum(p and not t for p, t in zip(pred, y))
    fn = sum((not p) and t for p, t in zip(pred, y))
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a simulator directory (a warm start or an export's merged weights)")
    ap.add_argument("--turns", type=int, default=600, help="real test turns to read")
    ap.add_argument("--max_context_tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import numpy as np
    from sklearn.metrics import roc_auc_score

    from conversations.precision import resolve_precision
    from generator.data import load_turns
    from generator.engine import Engine
    from generator.ending import end_probabilities
    from generator.model import load_generator
    from generator.prompts import render_prompt

    records = [r for r in load_turns("sharegpt", "test", max_context_messages=2, max_turn_chars=300)
               if any(m["role"] == "user" for m in r.context)]  # after a user opening: what the meter judges
    random.Random(args.seed).shuffle(records)
    records = records[: args.turns]
    model, tok = load_generator(args.model, dtype="fp32")
    precision = resolve_precision("auto")
    t0 = time.perf_counter()
    prompts = [render_prompt(tok, r.context, max_context_tokens=args.max_context_tokens) for r in records]
    p = end_probabilities(Engine(model, tok, precision=precision), prompts, [r.user_turn for r in records])
    secs = time.perf_counter() - t0
    y = np.array([r.is_last for r in records])
    rate = float(y.mean())
    thresholds = np.quantile(p, np.linspace(0.01, 0.99, 99))
    best = max(thresholds, key=lambda t: f1_at(p >= t, y))
    matched = np.quantile(p, 1 - rate)
    draws = [f1_at(np.random.default_rng(s).random(len(p)) < p, y) for s in range(20)]
    print(json.dumps({
        "model": args.model, "turns": len(records), "real_end_rate": round(rate, 4),
        "mean_p_end": round(float(p.mean()), 4), "auc": round(float(roc_auc_score(y, p)), 4),
        "f1_best_threshold": round(f1_at(p >= best, y), 4), "best_threshold": round(float(best), 4),
        "f1_matched_rate": round(f1_at(p >= matched, y), 4),
        "f1_bernoulli_mean": round(float(np.mean(draws)), 4), "f1_chance_at_rate": round(rate, 4),
        "seconds": round(secs, 1), "precision": precision,
    }, indent=1))


if __name__ == "__main__":
    main()
