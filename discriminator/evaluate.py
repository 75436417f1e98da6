"""Measure the Turing distance between real and simulated users, turn by turn or whole conversations.

    python -m discriminator.evaluate --real REAL --simulated SIM [--detectors classical style neural] [--folds 5]
        [--seed 0] --out report.json
    python -m discriminator.evaluate --level conversation --seed-user-turns 1 --real REAL --simulated SIM --out r.json
    python -m discriminator.evaluate --judge single --judge-model openai:MODEL@URL --level conversation ...
    python -m discriminator.evaluate --judge pairwise --judge-model hf:smollm2-135m-instruct --real R --simulated S ...

REAL and SIM: conversations in any format the data layer reads or turn records `{id, context, user_turn}` (JSONL or
a JSON array). `--level turn` (default): every user turn is an item. `--level conversation`: every conversation is
one item, its user side after the first `--seed-user-turns` user turns (`discriminator.conversation`), with the same
fresh detectors, balancing, grouped cross-fitting and bootstrap. The larger side is sampled down to the smaller one
(fixed seed). `--judge single|pairwise`: an LLM judge instead of the detectors (`discriminator.judges`; single reads
whole conversations, pairwise real and simulated turns of the same contexts), through an OpenAI-compatible endpoint
(key from `--judge-api-key-env`, requests cached in `--judge-cache`) or a local model (`hf:MODEL`).
Writes the report (definition and fields: docs/turing-distance.md) and prints it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from conversations import DataError, read_items
from conversations.cli_util import friendly_errors
from discriminator.turing import DEFAULT_PANEL, MIN_ITEMS, NEURAL_PANEL_DEFAULTS, detector_names, measure_td


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m discriminator.evaluate",
        description="Turing distance (TD = |accuracy - 50|) of simulated against real user turns, measured "
        "out-of-fold by a panel of fresh detectors. See docs/turing-distance.md.",
    )
    p.add_argument("--real", required=True, help="real (human) conversations or turn records")
    p.add_argument("--simulated", required=True, help="simulated conversations or turn records")
    p.add_argument("--format", default="auto", help="input format for both files (default: auto-detect)")
    p.add_argument(
        "--detectors", nargs="+", default=list(DEFAULT_PANEL),
        help=f"detector panel, space or comma separated (default: {' '.join(DEFAULT_PANEL)}; "
        f"available: {', '.join(detector_names())}); 'classical style' alone takes seconds",
    )
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples for the 95%% interval")
    p.add_argument("--backbone", default=None, help="neural detector backbone (default: minilm-l6)")
    p.add_argument("--epochs", type=int, default=None, help=f"neural epochs (default {NEURAL_PANEL_DEFAULTS['epochs']})")
    p.add_argument("--max-length", type=int, default=None, help="neural max tokens per item")
    p.add_argument("--context-tokens", type=int, default=None, help="neural context budget (tokens, from the left)")
    p.add_argument("--lora", action="store_true", help="train the neural detector with LoRA")
    p.add_argument("--level", choices=("turn", "conversation"), default="turn")
    p.add_argument("--seed-user-turns", type=int, default=0,
                   help="conversation level: real user turns every simulation started from (left out of the items)")
    p.add_argument("--judge", choices=("single", "pairwise"), default=None, help="an LLM judge instead of the detectors")
    p.add_argument("--judge-model", default=None, help="openai:MODEL@BASE_URL or hf:MODEL")
    p.add_argument("--judge-api-key-env", default="OPENAI_API_KEY")
    p.add_argument("--judge-cache", default=None, help="folder caching the judge's replies by request hash (resume)")
    p.add_argument("--judge-workers", type=int, default=8, help="concurrent judge requests")
    p.add_argument("--out", required=True, help="report.json path")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def _load(path: str, fmt: str, side: str):
    items = read_items(path, fmt)
    if len(items) < MIN_ITEMS:
        raise DataError(f"only {len(items)} {side} user turn(s); the meter needs at least {MIN_ITEMS} on each side", path)
    return items


def _fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def format_table(report: dict) -> str:
    lo, hi = report["td_ci95"]
    lines = [
        f"Turing distance {report['td']:.1f}  [95% CI {lo:.1f}, {hi:.1f}]  "
        f"(headline: {report['headline_detector']}; signed {report['signed']:+.1f}, AUC {report['auc']:.3f})",
        f"n_real {report['n_real']} (of {report['n_real_input']}), n_simulated {report['n_simulated']} "
        f"(of {report['n_simulated_input']}), {report['folds']} grouped folds, {report['n_groups']} groups, "
        f"paired contexts {report['n_paired_contexts']}",
        *([f"old panel ({' '.join(report['old_panel']['detectors'])}): td {report['old_panel']['td']:.1f}  [95% CI "
           f"{report['old_panel']['td_ci95'][0]:.1f}, {report['old_panel']['td_ci95'][1]:.1f}]"]
          if report.get("old_panel") else []),
        *([f"paired td (panel maximum, same-context pairs): {report['paired_td']:.1f}"]
          if report.get("paired_td") is not None else []),
        "",
        f"{'detector':<12}{'accuracy':>9}{'AUC':>8}{'TD':>7}{'TD 95% CI':>16}{'signed':>8}{'paired':>8}{'fit s':>8}",
    ]
    for name, d in report["detectors"].items():
        ci = f"[{d['td_ci95'][0]:.1f}, {d['td_ci95'][1]:.1f}]"
        lines.append(
            f"{name:<12}{d['accuracy']:>9.1f}{d['auc']:>8.3f}{d['td']:>7.1f}{ci:>16}{d['signed']:>+8.1f}"
            f"{_fmt(d['paired_accuracy']):>8}{d['fit_seconds']:>8.1f}"
        )
    return "\n".join(lines)


def _conversations(path: str, fmt: str, side: str):
    from conversations import load_conversations

    convs, _ = load_conversations(path, fmt)
    if not convs:
        raise DataError(f"no {side} conversations", path)
    return convs


def conversation_level(args):
    from discriminator.conversation import conversation_items

    real = conversation_items(_conversations(args.real, args.format, "real"), args.seed_user_turns)
    sim = conversation_items(_conversations(args.simulated, args.format, "simulated"), args.seed_user_turns, "@sim")
    for side, items, path in (("real", real, args.real), ("simulated", sim, args.simulated)):
        if len(items) < MIN_ITEMS:
            raise DataError(f"only {len(items)} {side} conversation(s) with user turns after the seed; the meter "
                            f"needs at least {MIN_ITEMS}", path)
    return real, sim


def run_judge(args) -> int:
    from discriminator.judges import judge_pairwise, judge_single, make_judge

    if not args.judge_model:
        raise DataError("--judge needs --judge-model openai:MODEL@BASE_URL or hf:MODEL")
    if args.judge_workers < 1:
        raise DataError(f"--judge-workers must be >= 1, got {args.judge_workers}")
    judge = make_judge(args.judge_model, cache_dir=args.judge_cache, max_workers=args.judge_workers,
                       api_key_env=args.judge_api_key_env)
    if args.judge == "single":
        rep = judge_single(judge, _conversations(args.real, args.format, "real"),
                           _conversations(args.simulated, args.format, "simulated"), n_boot=args.n_boot, seed=args.seed)
    else:
        rep = judge_pairwise(judge, read_items(args.real, args.format), read_items(args.simulated, args.format),
                             n_boot=args.n_boot, seed=args.seed)
    doc = {**rep.to_dict(), "inputs": {"real": str(args.real), "simulated": str(args.simulated)}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    lo, hi = rep.td_ci95
    print(f"{rep.protocol} judge {rep.judge}: accuracy {rep.accuracy:.1f} on {rep.n}, td {rep.td:.1f} [95% CI {lo:.1f}, "
          f"{hi:.1f}]; " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in rep.extra.items()))
    print(f"report: {out}")
    return 0


@friendly_errors
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from conversations.cli_util import start_process

    start_process()
    detectors = [d for arg in args.detectors for d in arg.split(",") if d]
    unknown = [d for d in detectors if d not in detector_names()]
    if unknown:
        raise DataError(f"unknown detector {unknown[0]!r} (choose from {', '.join(detector_names())})", "--detectors")
    for flag, value, low in (("--folds", args.folds, 2), ("--n-boot", args.n_boot, 1), ("--seed", args.seed, 0),
                             ("--epochs", args.epochs, 1), ("--max-length", args.max_length, 32),
                             ("--context-tokens", args.context_tokens, 0)):
        if value is not None and value < low:
            raise DataError(f"{flag} must be >= {low}, got {value}")
    if args.backbone is not None:
        from conversations.assets import check_model_name

        check_model_name(args.backbone, "--backbone")
    neural_kwargs = {}
    for key, val in (("backbone", args.backbone), ("epochs", args.epochs), ("max_length", args.max_length),
                     ("context_tokens", args.context_tokens)):
        if val is not None:
            neural_kwargs[key] = val
    if args.lora:
        neural_kwargs["lora"] = True
    if args.judge:
        return run_judge(args)
    if args.level == "conversation":
        real, sim = conversation_level(args)
    else:
        real = _load(args.real, args.format, "real")
        sim = _load(args.simulated, args.format, "simulated")
    log = None if args.quiet else (lambda msg: print(f"[td] {msg}", file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    report = measure_td(
        real, sim, detectors=detectors, folds=args.folds, seed=args.seed, n_boot=args.n_boot,
        neural_kwargs=neural_kwargs, progress=log,
    )
    report["seconds"] = round(time.perf_counter() - t0, 2)
    report["inputs"] = {"real": str(args.real), "simulated": str(args.simulated), "level": args.level}
    if "neural" in detectors:
        report["neural_settings"] = {**NEURAL_PANEL_DEFAULTS, **neural_kwargs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report))
    for w in report.get("warnings", []):
        print(f"warning: {w}")
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
