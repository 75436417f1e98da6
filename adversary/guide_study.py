"""Two guided exports of one warm start that differ only in their guide: the current guide (the char n-gram
classifier the main job's export carries) and one built on the language-model judge. Compare them with
`adversary.compare`, which samples every simulator's K candidates from the same seed, so the two guides choose among
the same turns:

    python -m adversary.guide_study --model WS --judge JUDGE --train-real R --train-sim S --out OUT \
        [--fit-pairs 2000] [--calib-pairs 1000] [--k 4]
    python -m adversary.compare --simulators frozen:OUT/classical frozen:OUT/lmjudge "frozen:OUT/classical#guidance=1" \
        --out OUT/compare --turn_contexts 200 --conversations 32 --max_turns 1

WS: the warm start's merged weights; JUDGE: a judge `LMJudge.save` wrote (`adversary.judge_study` fits one on the
warm start's own turns); R/S: real turns and the warm start's turns for the same TRAIN contexts (`generator.simulate
--real_out`). The n-gram guide is fitted on the first `fit-pairs` pairs (the pairs the judge learned from, when it
came from `adversary.judge_study --pairs` with the same number); both guides are then Platt-calibrated on the next
`calib-pairs` pairs, which neither has seen. OUT/guide_study.json records both guides' paired and pointwise accuracy
on those pairs before calibration and their calibration.
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

from conversations import DataError
from conversations.cli_util import friendly_errors


def build_parser():
    p = argparse.ArgumentParser(prog="python -m adversary.guide_study", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="the warm start's merged weights (a model folder)")
    p.add_argument("--judge", required=True, help="a folder LMJudge.save wrote")
    p.add_argument("--train-real", required=True)
    p.add_argument("--train-sim", required=True)
    p.add_argument("--out", required=True, help="folder: OUT/classical, OUT/lmjudge (exports), OUT/guide_study.json")
    p.add_argument("--fit-pairs", type=int, default=2000, help="pairs the n-gram guide is fitted on")
    p.add_argument("--calib-pairs", type=int, default=1000, help="the next pairs: both guides' calibration")
    p.add_argument("--k", type=int, default=4, help="candidates a turn")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--max-prompt-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    return p


def calibrated_guide(disc, calib_real, calib_sim, k: int):
    """A `Guide` of `disc` Platt-scaled on the (real, sim) calibration pairs, and its report."""
    from adversary.guidance import Guide
    from discriminator.calibration import PlattScaler, calibration_report

    raw = np.asarray(disc.score([*calib_real, *calib_sim]), dtype=np.float64)
    y = np.array([1] * len(calib_real) + [0] * len(calib_sim))
    d = raw[:len(calib_real)] - raw[len(calib_real):]
    scaler = PlattScaler().fit(raw, y)
    report = {"calibration_pairs": len(calib_real), "paired_accuracy": 100.0 * float(np.mean((d > 0) + 0.5 * (d == 0))),
              "heldback": calibration_report(raw, y, scaler), "platt": scaler.to_dict()}
    return Guide(disc, (scaler.a, scaler.b), k, "resample", report=report), report


@friendly_errors
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not Path(args.judge, "discriminator.json").exists():
        raise DataError("not a folder LMJudge.save wrote (no discriminator.json)", args.judge)
    from conversations.cli_util import start_process

    start_process()
    from adversary.discriminator import Discriminator
    from adversary.export import export_frozen
    from adversary.guidance import GUIDE_DIR
    from adversary.judge_study import pairs_of
    from discriminator.lm_judge import LMJudge
    from generator.model import load_generator
    from generator.prompts import PROMPT_FORMAT_VERSION

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    real, sim = pairs_of(args.train_real, args.train_sim)
    n_fit, n_cal = args.fit_pairs, args.calib_pairs
    if len(real) < n_fit + n_cal:
        raise DataError(f"{len(real)} pairs; --fit-pairs {n_fit} + --calib-pairs {n_cal} need more", args.train_real)
    cal_real, cal_sim = real[n_fit:n_fit + n_cal], sim[n_fit:n_fit + n_cal]
    doc = {"args": vars(args), "date": time.strftime("%Y-%m-%d"), "guides": {}}

    t0 = time.perf_counter()
    # its pool holds every fit pair: a loaded guide refits the n-gram member from the pool
    ngram = Discriminator(None, classical=True, weights=(0.0, 1.0), pool_size=2 * n_fit, seed=args.seed)
    ngram.fit([*real[:n_fit], *sim[:n_fit]], np.array([1] * n_fit + [0] * n_fit))
    guides = {"classical": (ngram, {"fit_pairs": n_fit, "fit_seconds": round(time.perf_counter() - t0, 1)})}
    judge = LMJudge.load(args.judge)
    guides["lmjudge"] = (Discriminator(judge, classical=False, weights=(1.0, 0.0), seed=args.seed),
                         {"judge": str(args.judge), "judge_step": judge.step})

    model, tok = load_generator(args.model)
    sampling = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": 0.95, "top_k": 0,
                "min_new_tokens": 1, "max_prompt_tokens": args.max_prompt_tokens}
    for name, (disc, info) in guides.items():
        t0 = time.perf_counter()
        guide, report = calibrated_guide(disc, cal_real, cal_sim, args.k)
        report.update(info, calibration_seconds=round(time.perf_counter() - t0, 1))
        doc["guides"][name] = report
        print(f"{name} guide: paired {report['paired_accuracy']:.1f} on {n_cal} calibration pairs, ECE "
              f"{report['heldback']['raw']['ece']:.3f} -> {report['heldback']['calibrated']['ece']:.3f}", flush=True)
        manifest = {"base_model": args.model, "warm_start": args.model, "sampling": sampling,
                    "prompt_format_version": PROMPT_FORMAT_VERSION, "objective": "guided decoding (guide_study)",
                    "guidance": {"k": args.k, "rule": "resample", "dir": GUIDE_DIR, "members": [name],
                                 "calibration": report["heldback"]}}
        if not (out / name / "simulator.json").exists():  # a rerun keeps an export already written
            export_frozen(model, tok, out / name, manifest,
                          extra=lambda folder, g=guide: g.save(Path(folder) / GUIDE_DIR))
        (out / "guide_study.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"exports: {out / 'classical'}, {out / 'lmjudge'}; report: {out / 'guide_study.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
