"""The controlled comparison: two agents trained identically except for their user simulator, evaluated on the same
unseen simulators and tasks, simulator by simulator.

    python -m agent_rl.compare --agents A B --simulators S1 S2 ... [--gyms ...] [--episodes N] --out DIR

For each simulator: both agents' overall scores and the delta B - A (x 100) with a 95% paired bootstrap CI (the same
resampled tasks for both agents, stratified by gym), per gym and overall; then how many simulators improved (delta > 0)
and how many significantly (CI above 0). Writes DIR/compare.csv, DIR/compare.md, DIR/compare.json and, per agent,
DIR/matrix_A.* / DIR/matrix_B.*. Episodes are cached in DIR/episodes.jsonl (shared with agent_rl.evaluate).
"""

from __future__ import annotations

import csv
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conversations.cli_util import friendly_errors, parse_cli
from conversations.config import ConfigError

from agent_rl import stats
from agent_rl.evaluate import RunArgs, run_agent, score_matrix, write_matrix

log = logging.getLogger("agent_rl.compare")


@dataclass
class CompareArgs(RunArgs):
    agents: list[str] = field(default_factory=list, metadata={"help": "exactly two agents: A (baseline) and B"})

    def __post_init__(self):
        super().__post_init__()
        from agent_rl.agents import check_agent_spec

        if len(self.agents) != 2:
            raise ConfigError(f"--agents takes exactly two agents (A B), got {len(self.agents)}")
        for spec in self.agents:
            check_agent_spec(spec)


def _paired(records_a, records_b, simulator: str, gym: str):
    """Returns of both agents on the (task, seed) pairs both finished, in the same order."""
    key = lambda r: (r["task_id"], r["seed"])  # noqa: E731
    a = {key(r): r["return"] for r in records_a if r["simulator"] == simulator and r["gym"] == gym}
    b = {key(r): r["return"] for r in records_b if r["simulator"] == simulator and r["gym"] == gym}
    common = sorted(a.keys() & b.keys())
    return [a[k] for k in common], [b[k] for k in common]


def compare_records(records_a, records_b, gyms: list[str], simulators: list[str], seed: int = 0) -> dict[str, Any]:
    rows = []
    for s in simulators:
        pairs = {g: _paired(records_a, records_b, s, g) for g in gyms}
        for g in gyms:
            d, lo, hi = stats.paired_delta_ci({g: pairs[g]}, seed)
            rows.append({"simulator": s, "gym": g, "n": len(pairs[g][0]),
                         "score_a": stats.mean_ci(pairs[g][0], seed)[0], "score_b": stats.mean_ci(pairs[g][1], seed)[0],
                         "delta": d, "ci_low": lo, "ci_high": hi})
        d, lo, hi = stats.paired_delta_ci(pairs, seed)
        rows.append({"simulator": s, "gym": "overall", "n": sum(len(p[0]) for p in pairs.values()),
                     "score_a": stats.overall_ci({g: p[0] for g, p in pairs.items()}, seed)[0],
                     "score_b": stats.overall_ci({g: p[1] for g, p in pairs.items()}, seed)[0],
                     "delta": d, "ci_low": lo, "ci_high": hi})
    overall = [r for r in rows if r["gym"] == "overall"]
    return {
        "rows": rows,
        "improved": sum(r["delta"] > 0 for r in overall),
        "improved_significantly": sum(r["ci_low"] > 0 for r in overall),
        "worse_significantly": sum(r["ci_high"] < 0 for r in overall),
        "simulators": len(overall),
        "mean_delta": sum(r["delta"] for r in overall) / max(1, len(overall)),
    }


def write_comparison(result: dict[str, Any], agents: list[str], out_dir: str | Path) -> dict[str, Path]:
    from agent_rl.users import short_label

    out = Path(out_dir)
    with open(out / "compare.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(result["rows"][0]))
        w.writeheader()
        for r in result["rows"]:
            w.writerow({k: f"{v:.4f}" if isinstance(v, float) else v for k, v in r.items()})
    a, b = agents
    lines = [
        "# Controlled comparison", "",
        f"A = `{a}`, B = `{b}`. Scores x 100 (UserRL: per gym the mean of summed turn rewards; overall = mean over "
        "gyms). Delta = B - A with a 95% paired bootstrap CI over the same tasks.", "",
        *overall_lines(result["rows"], "A", "B"),
        "", verdict_line(result, result["simulators"], "B"), "", "## Per gym", "",
        "| simulator | gym | n | A | B | delta [95% CI] |", "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if r["gym"] != "overall":
            lines.append(f"| {short_label(r['simulator'])} | {r['gym']} | {r['n']} | {r['score_a']:.1f} | "
                         f"{r['score_b']:.1f} | {r['delta']:+.1f} [{r['ci_low']:+.1f}, {r['ci_high']:+.1f}] |")
    (out / "compare.md").write_text("\n".join(lines) + "\n")
    (out / "compare.json").write_text(json.dumps({"agents": agents, **result}, indent=2))
    return {"csv": out / "compare.csv", "md": out / "compare.md", "json": out / "compare.json"}


def overall_lines(rows: list[dict], a: str, b: str, *, episodes: bool = False) -> list[str]:
    """The markdown table of the overall rows: per simulator, A's and B's scores and B - A with its paired CI."""
    from agent_rl.users import short_label

    lines = ["| simulator | " + ("episodes | " if episodes else "") + f"{a} | {b} | delta {b} - {a} [95% CI] |",
             "|---|" + "---|" * (4 if episodes else 3)]
    for r in rows:
        if r["gym"] == "overall":
            n = f"{r['n']} | " if episodes else ""
            lines.append(f"| {short_label(r['simulator'])} | {n}{r['score_a']:.1f} | {r['score_b']:.1f} | "
                         f"{r['delta']:+.1f} [{r['ci_low']:+.1f}, {r['ci_high']:+.1f}] |")
    return lines


def verdict_line(c: dict, n_simulators: int, b: str) -> str:
    return (f"{b} improved on {c['improved']} of {n_simulators} simulators ({c['improved_significantly']} with the CI "
            f"above 0, {c['worse_significantly']} with it below 0); mean delta {c['mean_delta']:+.1f}.")


def compare(args: CompareArgs) -> dict[str, Any]:
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    recs = []
    for label, spec in zip("AB", args.agents):
        r = run_agent(spec, args)  # one agent in memory at a time
        write_matrix(score_matrix(r, args.gym_list, args.simulators, args.seed), args.gym_list, args.out,
                     f"{label}: {spec} on {args.split} tasks", prefix=f"matrix_{label}")
        recs.append(r)
    result = compare_records(recs[0], recs[1], args.gym_list, args.simulators, args.seed)
    paths = write_comparison(result, args.agents, args.out)
    return {**result, "paths": {k: str(v) for k, v in paths.items()}}


@friendly_errors
def main(argv: list[str] | None = None) -> int:
    (args,) = parse_cli((CompareArgs,), argv, prog="python -m agent_rl.compare")
    res = compare(args)
    print(Path(res["paths"]["md"]).read_text())
    print(json.dumps({"improved": res["improved"], "simulators": res["simulators"], **res["paths"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
