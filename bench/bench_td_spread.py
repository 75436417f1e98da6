"""How far a held-out td reading moves with the sampling of the simulated turns alone (the meter's bootstrap CI holds
the turns fixed), for one or more simulators of a finished run.

    python bench/bench_td_spread.py --simulators runs/demo/warmstart/merged runs/demo/frozen --seeds 5

For each simulator (a model folder: the warm start's merged weights, an export): the preset's held-out contexts
are simulated `--seeds` times, each with another sampling seed (the meter's own seed first), by the engine at the
preset's held-out settings, and each set of turns is scored by the preset's fresh detector panel with its fold seed
fixed, exactly as `adversary.heldout.HeldoutMeter` does. Reported per simulator: every reading, their mean and
standard deviation, and the mean bootstrap CI half-width, and for each pair of simulators the difference of the
means with its standard error. Prints one JSON line."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, emit, log, r  # noqa: E402


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    p.add_argument("--simulators", nargs="+", required=True, help="model folders (merged weights or an export)")
    p.add_argument("--seeds", type=int, default=5, help="sampling seeds per simulator")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    from adversary.heldout import HELDOUT_SEED, measure_heldout, simulate_heldout
    from adversary.stages import prepare_data
    from adversary.train import parse_args, quiet_libraries
    from conversations.memory import release_memory
    from generator.engine import inference_copy
    from generator.model import load_generator

    quiet_libraries()
    cfg, _ = parse_args(["--config", a.config, "--output_dir", str(ROOT / "outputs" / "bench_td_spread"),
                         "--report_to", "none"])
    data = prepare_data(cfg, 0)
    out = {"bench": "td_spread", "config": Path(a.config).name, "contexts": len(data.heldout),
           "detectors": list(cfg.heldout_detectors), "seeds": [HELDOUT_SEED + k for k in range(a.seeds)], "simulators": {}}
    for path in a.simulators:
        model, tok = load_generator(path)
        model = inference_copy(model, cfg.dtype)
        tds, half = [], []
        for seed in out["seeds"]:
            sims = simulate_heldout(model, tok, data.heldout, cfg, seed=seed, precision=cfg.dtype)
            row = measure_heldout(data.heldout, sims, cfg, seed=0)
            tds.append(row["td/panel"])
            half.append((row["td/ci_high"] - row["td/ci_low"]) / 2)
            log(f"{path} seed {seed}: td {row['td/panel']:.2f} ({row['td/ci_low']:.1f}-{row['td/ci_high']:.1f})")
            release_memory()
        del model
        release_memory()
        out["simulators"][path] = {"td": [r(t, 2) for t in tds], "mean": r(statistics.mean(tds), 2),
                                   "sd": r(statistics.stdev(tds), 2) if len(tds) > 1 else None,
                                   "range": r(max(tds) - min(tds), 2), "ci_half_width_mean": r(statistics.mean(half), 2)}
    names = list(out["simulators"])
    out["differences"] = {}
    for i, x in enumerate(names):
        for y in names[i + 1 :]:
            sx, sy = out["simulators"][x], out["simulators"][y]
            if sx["sd"] is None:
                continue
            se = (sx["sd"] ** 2 / a.seeds + sy["sd"] ** 2 / a.seeds) ** 0.5
            out["differences"][f"{y} - {x}"] = {"mean": r(sy["mean"] - sx["mean"], 2), "se": r(se, 2)}
    emit(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
