"""Where one reading of the main job's meter spends its time and memory, part by part; prints one JSON line.

A reading of `configs/demo.yaml` (`adversary.heldout.HeldoutMeter.evaluate`) samples `meter_seeds` turns per held-out
context in one call, solves the end decision's offset, continues the held-out conversations, then fits the detector panels.
The default run spends ~200 s a reading on it (4 readings, ~43% of its wall time: docs/studies/default-run.md "The default
run"); this script runs the same calls in the same order on one model and times each, so the default run's budget
(issue #26) can be cut where the time is.

    python bench/bench_meter_reading.py --model runs/agent34/warmstart     # a merged warm start of make demo
    python bench/bench_meter_reading.py --model smollm2-135m-instruct      # the base model (no warm start at hand)
    python bench/bench_meter_reading.py --model M -- --conv_contexts 24    # anything after -- overrides the preset

Figures: `seconds` per part, `rss_mb` the process's resident set after each part and `peak_rss_mb`
its peak so far. Run it alone on the machine.

The parts are `HeldoutMeter.evaluate`'s calls in its order, written out here so each can be timed: a change to the
meter's sequence must be mirrored here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def rss_mb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2**20


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a merged model directory or a registered model name")
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)

    from conversations.cli_util import start_process

    threads = start_process(announce=False)
    from adversary.config import parse_job
    from adversary.conversation_meter import (calibrated_end_bias, measure_conversations,
                                             simulate_heldout_conversations)
    from adversary.heldout import HELDOUT_SEED, heldout_settings, measure_heldout, simulate_heldout_samples
    from adversary.stages import prepare_data
    from conversations.memory import peak_rss_mb, release_memory
    from conversations.seeds import seed_for
    from generator.engine import policy_model
    from generator.model import load_generator

    cfg, _targs = parse_job((), ["--config", args.config, *extra], prog="bench_meter_reading")
    parts, t_all = {}, time.perf_counter()

    def timed(name, fn):
        t0 = time.perf_counter()
        out = fn()
        parts[name] = {"seconds": round(time.perf_counter() - t0, 1), "rss_mb": rss_mb(), "peak_rss_mb": peak_rss_mb()}
        return out

    data = timed("data", lambda: prepare_data(cfg, 0))
    model, tok = timed("load", lambda: load_generator(args.model))
    seed = seed_for("meter_seed", HELDOUT_SEED, 0)
    release_memory()
    with policy_model(model, precision=cfg.dtype) as m:
        per_seed = timed("turns", lambda: simulate_heldout_samples(m, tok, data.heldout, cfg, cfg.meter_seeds,
                                                                   seed=seed, precision=cfg.dtype))
        settings, end_bias, sims_conv = heldout_settings(cfg), None, None
        if data.heldout_convs and data.end_contexts:
            end_bias = timed("end_offset_solve", lambda: calibrated_end_bias(
                m, tok, data.end_contexts, cfg, settings, data.real_end_rate, seed, precision=cfg.dtype))
            settings = settings.replace(end_bias=end_bias)
        if data.heldout_convs:
            sims_conv = timed("conversations", lambda: simulate_heldout_conversations(
                m, tok, data.heldout_convs, cfg, settings, seed, precision=cfg.dtype))
    rows = [timed(f"panel_seed{i}", lambda s=s: measure_heldout(data.heldout, s, cfg)) for i, s in enumerate(per_seed)]
    if sims_conv is not None:
        conv = timed("conversation_panel", lambda: measure_conversations(data.heldout_convs, sims_conv, cfg))
    else:
        conv = {}
    out = {
        "model": args.model, "config": args.config, "overrides": extra, "threads": threads.to_dict(),
        "heldout_contexts": len(data.heldout), "meter_seeds": cfg.meter_seeds, "sim_batch_size": cfg.sim_batch_size,
        "conv_contexts": len(data.heldout_convs), "end_contexts": len(data.end_contexts),
        "parts": parts, "reading_seconds": round(sum(v["seconds"] for k, v in parts.items()
                                                     if k not in ("data", "load")), 1),
        "wall_seconds": round(time.perf_counter() - t_all, 1),
        "td_per_seed": [round(r["td/panel"], 2) for r in rows], "conv_td": conv.get("conv/td"),
        "end_bias": end_bias, "load_avg_1min": os.getloadavg()[0],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
