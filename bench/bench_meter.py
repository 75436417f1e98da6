"""Benchmark of the Turing-distance meter on CPU; prints one JSON line.

- Panel fit and score time on 2 x N real turns (default N = 1,000; the "simulated" side is the other half of the
  corpus, so texts have realistic lengths): each detector fitted once on all 2N items and scoring all 2N items.
- `measure_td` wall time with the fast panel (classical + style, 5 folds, 1,000 bootstrap resamples) at 2 x N and at
  2 x 300 (the size the adversarial loop measures at every evaluation).

    python bench/bench_meter.py [--n 1000] [--no-neural] [--skip-measure] [--threads N]

Times depend heavily on what else runs on the machine; the line reports the 1-minute load average at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000, help="turns per side")
    ap.add_argument("--no-neural", action="store_true")
    ap.add_argument("--skip-measure", action="store_true")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's choice); on a shared, oversubscribed CPU 1 is faster")
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    from discriminator.controls import real_halves
    from discriminator.turing import FAST_PANEL, NEURAL_PANEL_DEFAULTS, make_detector, measure_td

    real, other = real_halves(args.n, seed=0)
    items = real + other
    labels = [1] * len(real) + [0] * len(other)
    out: dict = {"bench": "meter", "n_per_side": args.n, "cpu_count": os.cpu_count(), "load_avg_1m": None}
    panel = list(FAST_PANEL) + ([] if args.no_neural else ["neural"])
    fit_s, score_s = {}, {}
    for name in panel:
        kw = {"seed": 0}
        if name == "neural":
            kw.update(NEURAL_PANEL_DEFAULTS)
            t = time.perf_counter()
            det = make_detector(name, **kw)
            out["neural_build_s"] = round(time.perf_counter() - t, 2)
            out["neural_settings"] = NEURAL_PANEL_DEFAULTS
        else:
            det = make_detector(name, **kw)
        t = time.perf_counter()
        det.fit(items, labels)
        fit_s[name] = round(time.perf_counter() - t, 2)
        t = time.perf_counter()
        det.score(items)
        score_s[name] = round(time.perf_counter() - t, 2)
    out["fit_s"], out["score_s"] = fit_s, score_s
    out["panel_fit_s"] = round(sum(fit_s.values()), 2)
    out["panel_score_s"] = round(sum(score_s.values()), 2)
    if not args.skip_measure:
        t = time.perf_counter()
        r = measure_td(real, other, detectors=FAST_PANEL, folds=5, seed=0, n_boot=1000)
        out["measure_td_fast_panel_s"] = round(time.perf_counter() - t, 2)
        out["real_vs_real_td"] = round(r["td"], 2)
        out["real_vs_real_td_ci95"] = [round(x, 2) for x in r["td_ci95"]]
        t = time.perf_counter()
        measure_td(real[:300], other[:300], detectors=FAST_PANEL, folds=5, seed=0, n_boot=1000)
        out["measure_td_fast_panel_2x300_s"] = round(time.perf_counter() - t, 2)
    import torch

    out["torch_threads"] = torch.get_num_threads()
    out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
