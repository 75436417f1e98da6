"""The agents' report: every agent against one reference simulator, then the swap-only-the-simulator comparison.

    python -m agent_rl.report --agents untuned=hf:smollm2-135m-instruct sft=runs/agent30/sft \
        A=runs/agent30/grpo-hf B=runs/agent30/grpo-frozen --pair A B --reference scripted:oracle \
        --simulators scripted:terse hf:runs/demo/warmstart/merged ... --gyms all --out runs/agent30/report \
        --json docs/results/agents.json

1. Every agent plays the test tasks against `--reference` (the task's maximum is reachable there: the scripted oracle
   user answers what it is asked); per agent its score with a 95% CI and its episode count, and each agent's paired
   delta against every agent listed before it (the same tasks and seeds for both).
2. The two agents of `--pair` (A B: trained identically except for their simulator) play the same tasks against every
   `--simulators` entry (simulators neither met in training): `agent_rl.compare`'s table, B - A per simulator, with
   `--pair_repeats` episodes a task (an LM user's episode costs more than the scripted reference's).

Episodes are cached in OUT/episodes.jsonl (shared with `agent_rl.evaluate` and `agent_rl.compare`), so a rerun only
plays what is missing. Writes OUT/report.md and the JSON (`--json`, default OUT/agents.json).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conversations.cli_util import friendly_errors, parse_cli
from conversations.config import ConfigError

from agent_rl.compare import compare_records, overall_lines, verdict_line
from agent_rl.evaluate import RunArgs, run_agent, score_matrix

log = logging.getLogger("agent_rl.report")


@dataclass
class ReportArgs(RunArgs):
    agents: list[str] = field(default_factory=list, metadata={
        "help": "LABEL=SPEC for every agent (space-separated), in the order their deltas are read"})
    reference: str = field(default="scripted:oracle", metadata={
        "help": "the simulator every agent is scored against (where the tasks' maxima are reachable)"})
    pair: list[str] = field(default_factory=list, metadata={
        "help": "two labels A B from --agents: compared against every --simulators entry (B - A)"})
    pair_repeats: int = field(default=0, metadata={
        "help": "episodes per task for the pair's comparison (0: --repeats); a rerun with more reuses the cached ones"})
    json: str = field(default="", metadata={"help": "where the JSON goes (default: OUT/agents.json)"})

    def __post_init__(self):
        super().__post_init__()
        from agent_rl.agents import check_agent_spec
        from agent_rl.users import check_simulator_spec

        self.agent_specs: dict[str, str] = {}
        for item in self.agents:
            label, sep, spec = item.partition("=")
            if not sep or not label or not spec:
                raise ConfigError(f"--agents takes LABEL=SPEC items, got '{item}'")
            if label in self.agent_specs:
                raise ConfigError(f"--agents: the label '{label}' is given twice")
            check_agent_spec(spec)
            self.agent_specs[label] = spec
        if not self.agent_specs:
            raise ConfigError("give at least one agent: --agents LABEL=SPEC [...]")
        check_simulator_spec(self.reference)
        if self.pair_repeats < 0:
            raise ConfigError(f"--pair_repeats must be >= 0 (0: the same as --repeats), got {self.pair_repeats}")
        if self.pair and (len(self.pair) != 2 or any(p not in self.agent_specs for p in self.pair)):
            raise ConfigError(f"--pair takes two labels of --agents ({', '.join(self.agent_specs)}), got {self.pair}")


def _score(matrix_row) -> dict[str, Any]:
    n, mean, lo, hi = matrix_row
    return {"n": n, "score": mean, "ci_low": lo, "ci_high": hi}


def report(args: ReportArgs) -> dict[str, Any]:
    ref_args = dataclasses.replace(args, simulators=[args.reference])
    records = {label: run_agent(spec, ref_args) for label, spec in args.agent_specs.items()}
    labels = list(records)
    agents = {}
    for i, label in enumerate(labels):
        m = score_matrix(records[label], args.gym_list, [args.reference], args.seed)[args.reference]
        entry = {"spec": args.agent_specs[label], **_score(m["overall"]),
                 "by_gym": {g: _score(m[g]) for g in args.gym_list}, "deltas": {}}
        for other in labels[:i]:  # B - A on the same tasks and seeds, A the agent listed earlier
            row = compare_records(records[other], records[label], args.gym_list, [args.reference], args.seed)
            o = next(r for r in row["rows"] if r["gym"] == "overall")
            entry["deltas"][other] = {"delta": o["delta"], "ci_low": o["ci_low"], "ci_high": o["ci_high"],
                                      "n": o["n"]}
        agents[label] = entry
    out: dict[str, Any] = {"reference": args.reference, "gyms": args.gym_list, "split": args.split,
                           "repeats": args.repeats, "first_seed": args.first_seed, "agents": agents}
    if args.pair:
        a, b = args.pair
        sim_args = dataclasses.replace(args, simulators=list(args.simulators),
                                       repeats=args.pair_repeats or args.repeats)
        ra, rb = run_agent(args.agent_specs[a], sim_args), run_agent(args.agent_specs[b], sim_args)
        cmp = compare_records(ra, rb, args.gym_list, list(args.simulators), args.seed)
        overall = [r for r in cmp["rows"] if r["gym"] == "overall"]
        out["comparison"] = {
            "a": a, "b": b, "simulators": list(args.simulators), "repeats": sim_args.repeats,
            "episodes_per_agent_and_simulator": {r["simulator"]: r["n"] for r in overall},
            "improved": cmp["improved"], "improved_significantly": cmp["improved_significantly"],
            "worse_significantly": cmp["worse_significantly"], "mean_delta": cmp["mean_delta"],
            "rows": cmp["rows"],
        }
    return out


def render(result: dict[str, Any]) -> str:
    labels = list(result["agents"])
    lines = [f"# Agents against `{result['reference']}` ({result['split']} tasks, gyms: {', '.join(result['gyms'])})",
             "", "| agent | episodes | score [95% CI] | " + " | ".join(f"vs {x}" for x in labels[:-1]) + " |",
             "|---|---|---|" + "---|" * (len(labels) - 1)]
    for label, e in result["agents"].items():
        cells = []
        for other in labels[:-1]:
            d = e["deltas"].get(other)
            cells.append(f"{d['delta']:+.1f} [{d['ci_low']:+.1f}, {d['ci_high']:+.1f}]" if d else "")
        lines.append(f"| {label} | {e['n']} | {e['score']:.1f} [{e['ci_low']:.1f}, {e['ci_high']:.1f}] | "
                     + " | ".join(cells) + " |")
    lines += ["", "Per gym:", "", "| agent | " + " | ".join(result["gyms"]) + " |",
              "|---|" + "---|" * len(result["gyms"])]
    for label, e in result["agents"].items():
        lines.append(f"| {label} | " + " | ".join(f"{e['by_gym'][g]['score']:.1f}" for g in result["gyms"]) + " |")
    c = result.get("comparison")
    if c:
        lines += ["", f"## {c['b']} - {c['a']} on simulators neither met", "",
                  *overall_lines(c["rows"], c["a"], c["b"], episodes=True),
                  "", verdict_line(c, len(c["simulators"]), c["b"])]
    return "\n".join(lines) + "\n"


@friendly_errors
def main(argv: list[str] | None = None) -> int:
    (args,) = parse_cli((ReportArgs,), argv, prog="python -m agent_rl.report")
    result = report(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = render(result)
    (out / "report.md").write_text(text)
    json_path = Path(args.json or out / "agents.json")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2))
    print(text)
    print(json.dumps({"json": str(json_path), "md": str(out / "report.md")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
