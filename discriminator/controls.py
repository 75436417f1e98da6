"""Control sets for the meter, with known answers: real against real (TD should read near 0) and real against
obviously templated assistant-style text (TD should read near 50). Used by the tests, the benchmark, and as a sanity
check before trusting a new detector or setting."""

from __future__ import annotations

import random
from typing import Sequence

from conversations import TurnRecord, extract_turns
from conversations.seeds import seed_for

TEMPLATES = (
    "Certainly! Here is a comprehensive overview of {topic}:\n\n1. **Introduction**: {topic} is an important "
    "subject.\n2. **Key points**: There are several aspects to consider.\n\nI hope this helps! Let me know if you "
    "have any other questions.",
    "As an AI language model, I would be happy to help with {topic}. Here are some key considerations:\n\n"
    "- **First**: understand the basics.\n- **Second**: apply them carefully.\n\nIn conclusion, {topic} requires "
    "careful thought.",
    "Great question! {topic} can be broken down into the following steps:\n\n1. Research\n2. Planning\n3. "
    "Execution\n\nFeel free to ask if you need more details.",
)


def real_turns(n_conversations: int | None = None, seed: int = 0) -> list[list[TurnRecord]]:
    """Turns of the embedded ShareGPT corpus, as one list per conversation, conversations in a seeded random order."""
    from conversations.embedded import load_corpus

    convs, _ = load_corpus("sharegpt")
    convs = list(convs)
    random.Random(seed).shuffle(convs)
    if n_conversations is not None:
        convs = convs[:n_conversations]
    return [extract_turns([c]) for c in convs]


def real_halves(n_per_side: int, seed: int = 0) -> tuple[list[TurnRecord], list[TurnRecord]]:
    """Two disjoint samples of real turns, split by conversation (alternate conversations of a shuffled corpus), so
    a meter should find nothing between them."""
    per_conv = real_turns(n_conversations=max(4 * n_per_side, 200), seed=seed)
    a = [t for turns in per_conv[0::2] for t in turns]
    b = [t for turns in per_conv[1::2] for t in turns]
    rng = random.Random(seed_for("control_split", seed))
    if min(len(a), len(b)) < n_per_side:
        raise ValueError(f"not enough turns for {n_per_side} per side")
    return rng.sample(a, n_per_side), rng.sample(b, n_per_side)


def templated(items: Sequence[TurnRecord], seed: int = 0) -> list[TurnRecord]:
    """For each item, an obviously machine-written 'user turn' for the same context (a paired simulated set)."""
    rng = random.Random(seed)
    out = []
    for it in items:
        words = it.user_turn.split()[:4]
        topic = " ".join(words) if words else "this topic"
        out.append(
            TurnRecord(
                id=f"{it.id}/templated",
                context=[dict(m) for m in it.context],
                user_turn=rng.choice(TEMPLATES).format(topic=topic),
                conversation_id=it.conversation_id,
                is_last=it.is_last,
            )
        )
    return out


def run_controls(n_per_side: int, detectors, *, folds: int = 5, seed: int = 0, n_boot: int = 1000,
                 progress=None) -> dict:
    """Both controls through `measure_td` with one panel: real against real (two halves of real turns, split by
    conversation; should read near 0) and real against templated fakes for the same contexts (should read near 50)."""
    from discriminator.turing import measure_td

    a, b = real_halves(n_per_side, seed=seed)
    out = {}
    for name, real, sim in (("real_vs_real", a, b), ("templated", a, templated(a, seed=seed))):
        r = measure_td(real, sim, detectors=detectors, folds=folds, seed=seed, n_boot=n_boot, progress=progress)
        out[name] = {"td": r["td"], "td_ci95": r["td_ci95"], "paired_td": r["paired_td"],
                     "headline_detector": r["headline_detector"], "old_panel": r["old_panel"],
                     "detectors": {d: {k: v[k] for k in ("td", "td_ci95", "accuracy", "auc", "paired_td",
                                                         "fit_seconds")}
                                   for d, v in r["detectors"].items()}}
    return out


def main(argv=None) -> int:
    """python -m discriminator.controls [--n 300] [--detectors ...] --out controls.json"""
    import argparse
    import json
    import sys
    from pathlib import Path

    from discriminator.turing import DEFAULT_PANEL

    p = argparse.ArgumentParser(prog="python -m discriminator.controls",
                                description="The meter's controls: real against real, and templated fakes.")
    p.add_argument("--n", type=int, default=300, help="turns per side")
    p.add_argument("--detectors", nargs="+", default=list(DEFAULT_PANEL))
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    rep = run_controls(args.n, args.detectors, folds=args.folds, seed=args.seed,
                       progress=lambda m: print(f"[controls] {m}", file=sys.stderr, flush=True))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rep, indent=2) + "\n")
    for name, r in rep.items():
        old = f"; old panel {r['old_panel']['td']:.1f}" if r["old_panel"] else ""
        print(f"{name}: td {r['td']:.1f} [{r['td_ci95'][0]:.1f}, {r['td_ci95'][1]:.1f}] ({r['headline_detector']}){old}; "
              + ", ".join(f"{d} {v['td']:.1f}" for d, v in r["detectors"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
