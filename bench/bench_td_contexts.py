"""How a td reading depends on the number of contexts it is measured on (the detectors' training-set size), with the
simulator held fixed: the same simulated and real turns, subsampled to n contexts, several random subsets each.

    python bench/bench_td_contexts.py --real runs/guided/real.jsonl --sim runs/guided/sim_k1.jsonl
    python bench/bench_td_contexts.py --pool runs/guided/pool_2001.jsonl --k 16    # candidate 0 of a guided pool

The fresh detectors are cross-fitted on the subset, so a smaller n trains them on fewer turns: if td rises with n, a
reading is a property of the simulator *and* n, and two commands that read at different n disagree for that reason
alone (`adversary.compare` read 5.5 on 200 contexts where the study read 17.8 on 600, docs/results.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, log, r  # noqa: E402


def _read(path):
    from conversations.schema import TurnRecord

    with open(path, encoding="utf-8") as f:
        return [TurnRecord.from_dict(json.loads(line)) for line in f if line.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--real", default=None, help="real turn records (JSONL); with --pool: the test contexts' real turns")
    p.add_argument("--sim", default=None, help="simulated turn records, one per real id")
    p.add_argument("--pool", default=None, help="a guided pool (K candidates per context, context-major)")
    p.add_argument("--k", type=int, default=16, help="candidates per context in --pool")
    p.add_argument("--config", default="configs/guided.yaml", help="with --pool: where the test contexts come from")
    p.add_argument("--sizes", type=int, nargs="+", default=[100, 200, 400, 600, 1200])
    p.add_argument("--subsets", type=int, default=5)
    p.add_argument("--detectors", nargs="+", default=["classical", "style"])
    a = p.parse_args(argv)

    import numpy as np

    from discriminator.turing import measure_td

    if a.pool:
        from adversary.guided import GuidedConfig
        from adversary.config import parse_job
        from adversary.stages import prepare_data

        cfg, args, guided = parse_job((GuidedConfig,), ["--config", a.config], prog="bench_td_contexts")
        cfg.heldout_contexts = guided.test_contexts
        real = prepare_data(cfg, args.seed).heldout
        flat = _read(a.pool)
        sims = [flat[i * a.k] for i in range(len(flat) // a.k)]
    else:
        real, sims = _read(a.real), _read(a.sim)
    by_id = {s.id: s for s in sims}
    real = [x for x in real if x.id in by_id]
    rows = []
    for n in a.sizes:
        if n > len(real):
            continue
        tds = []
        for k in range(a.subsets if n < len(real) else 1):
            idx = np.sort(np.random.default_rng(k).choice(len(real), n, replace=False))
            rr = [real[i] for i in idx]
            rep = measure_td(rr, [by_id[x.id] for x in rr], detectors=tuple(a.detectors), folds=5, seed=0, n_boot=100)
            tds.append(rep["td"])
        rows.append({"contexts": n, "td_mean": r(np.mean(tds), 2), "td_sd": r(np.std(tds, ddof=1), 2) if len(tds) > 1
                     else 0.0, "td": [r(t, 2) for t in tds]})
        log(json.dumps(rows[-1]))
    emit({"bench": "td_contexts", "rows": rows, "detectors": a.detectors, "n_available": len(real)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
