"""Evaluate one agent against several user simulators: a gym x simulator matrix of UserRL-style scores.

    python -m agent_rl.evaluate --agent A --simulators S1 S2 ... [--gyms travel,function] [--episodes N] --out DIR

Writes DIR/matrix.csv, DIR/matrix.md (mean x 100 with a 95% bootstrap CI per cell; the `overall` row is the mean
over gyms) and DIR/heatmap.png. Every finished episode is appended to DIR/episodes.jsonl at once, keyed by agent,
simulator, gym, task, seed and a fingerprint of the generation settings, so an interrupted evaluation resumes where it
stopped and `agent_rl.compare` reuses the same file.
"""

from __future__ import annotations

import csv
import gc
import hashlib
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from conversations import DataError
from conversations.cli_util import friendly_errors, parse_cli
from conversations.config import ConfigError

from agent_rl import stats
from agent_rl.agents import EVAL_TEMPERATURE
from agent_rl.gyms import SPLITS, resolve_gyms
from agent_rl.users import UserSamplingArgs

log = logging.getLogger("agent_rl.evaluate")
EPISODES_FILE = "episodes.jsonl"


@dataclass
class RunArgs(UserSamplingArgs):
    """Shared by evaluate and compare: what to run and how to sample."""

    simulators: list[str] = field(default_factory=lambda: ["scripted:oracle"],
                                  metadata={"help": "user simulators to evaluate against (space-separated specs)"})
    gyms: str = field(default="all", metadata={"help": "comma-separated gyms, or 'all'"})
    episodes: int = field(default=0, metadata={"help": "tasks per gym: the first N of the split (0: all)"})
    split: str = field(default="test", metadata={"help": "task split: test (unseen tasks) or train"})
    repeats: int = field(default=1, metadata={"help": "episodes per task, with seeds first_seed..first_seed+repeats-1"})
    first_seed: int = field(default=0, metadata={
        "help": "the first episode seed: a confirmatory run takes seeds no earlier run read (fresh episodes)"})
    out: str = field(default="runs/eval", metadata={"help": "output folder (episodes.jsonl is the resume cache)"})
    max_turns: int = field(default=0, metadata={"help": "turn limit for every gym (0: each gym's own)"})
    max_live: int = field(default=128, metadata={
        "help": "episodes run in lock step at once (as many as the engine's cache budget holds: full batches, and "
                "every episode resumes each turn from its cache)"})
    agent_max_new_tokens: int = 64
    agent_temperature: float = field(default=EVAL_TEMPERATURE, metadata={
        "help": "agent sampling temperature (top-p 0.95): as deployed; training rollouts sample at 1 (agent_rl.agents)"})
    agent_batch_size: int = 16
    seed: int = 0
    device: str | None = None
    torch_threads: int = field(default=0, metadata={"help": "torch intra-op threads (0: torch's default)"})

    def __post_init__(self):
        from agent_rl.users import check_simulator_spec
        from conversations.config import check_ranges

        if self.split not in SPLITS:
            raise ConfigError(f"split must be one of {SPLITS}, got '{self.split}'")
        check_ranges(self, {"repeats": ">= 1", "max_live": ">= 1", "agent_max_new_tokens": ">= 1",
                            "agent_temperature": ">= 0", "agent_batch_size": ">= 1", "user_max_new_tokens": ">= 1",
                            "user_temperature": ">= 0", "user_top_p": "(0, 1]", "user_batch_size": ">= 1",
                            "episodes": ">= 0", "max_turns": ">= 0", "seed": ">= 0", "torch_threads": ">= 0",
                            "first_seed": ">= 0"})
        if not self.simulators:
            raise ConfigError("give at least one simulator: --simulators S1 [S2 ...]")
        for spec in self.simulators:
            check_simulator_spec(spec)
        self.gym_list = resolve_gyms(self.gyms)

    def fingerprint(self) -> str:
        """What changes an episode's distribution besides agent, simulator, task and seed."""
        keys = ("max_turns", "agent_max_new_tokens", "agent_temperature", "user_max_new_tokens", "user_temperature",
                "user_top_p")
        return hashlib.sha1(json.dumps({k: getattr(self, k) for k in keys}, sort_keys=True).encode()).hexdigest()[:10]


@dataclass
class EvalArgs(RunArgs):
    agent: str = field(default="scripted:oracle", metadata={"help": "scripted:oracle|random, hf:MODEL or a path"})

    def __post_init__(self):
        from agent_rl.agents import check_agent_spec

        super().__post_init__()
        check_agent_spec(self.agent)


def episode_key(agent: str, simulator: str, gym: str, task_id: str, seed: int, fingerprint: str) -> str:
    return f"{agent}|{simulator}|{gym}|{task_id}|{seed}|{fingerprint}"


def read_episodes(path: str | Path) -> list[dict[str, Any]]:
    """Cached episodes; a torn last line (an interrupted write) is skipped."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("%s:%d: unreadable line skipped (interrupted write?)", p, n)
    return out


def _end_torn_line(path: Path) -> None:
    """A write cut short leaves a last line without its newline: close it, or the next record would join it."""
    if path.exists() and path.stat().st_size:
        with open(path, "rb+") as f:
            f.seek(-1, 2)
            if f.read(1) != b"\n":
                f.write(b"\n")


def run_agent(agent_spec: str, args: RunArgs, agent=None) -> list[dict[str, Any]]:
    """Every (simulator, gym, task, seed) episode of one agent, from the cache where present, run otherwise (and
    appended to the cache as each finishes). Returns the records for this agent and these settings."""
    from agent_rl.agents import load_agent
    from agent_rl.rollout import episode_specs, run_episodes
    from agent_rl.users import load_simulator, user_settings

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cache_path = out_dir / EPISODES_FILE
    fp = args.fingerprint()
    cached = {r["key"]: r for r in read_episodes(cache_path)}
    seeds = range(args.first_seed, args.first_seed + args.repeats)
    specs = episode_specs(args.gym_list, args.split, args.episodes or None, seeds, args.max_turns or None)
    records = []
    for sim_spec in args.simulators:
        keys = [episode_key(agent_spec, sim_spec, s.gym, s.task.id, s.seed, fp) for s in specs]
        todo = [(k, s) for k, s in zip(keys, specs) if k not in cached]
        log.info("%s vs %s: %d episodes cached, %d to run", agent_spec, sim_spec, len(specs) - len(todo), len(todo))
        if todo:
            if agent is None:
                agent = load_agent(agent_spec, seed=args.seed, device=args.device,
                                   max_new_tokens=args.agent_max_new_tokens, temperature=args.agent_temperature,
                                   batch_size=args.agent_batch_size)
            simulator = load_simulator(sim_spec, user_settings(args), batch_size=args.user_batch_size, seed=args.seed,
                                       device=args.device)
            _end_torn_line(cache_path)
            with open(cache_path, "a", encoding="utf-8") as f:

                def save(i: int, result, _todo=todo, _f=f, _sim=sim_spec):
                    rec = {"key": _todo[i][0], "agent": agent_spec, "simulator": _sim, "fingerprint": fp,
                           **result.to_dict()}
                    _f.write(json.dumps(rec) + "\n")
                    _f.flush()  # one line per finished episode: a crash loses at most the running ones
                    cached[rec["key"]] = rec

                run_episodes(agent, simulator, [s for _, s in todo], max_live=args.max_live, on_result=save)
            del simulator
            gc.collect()
        records += [cached[k] for k in keys]
    return records


def score_matrix(records: Iterable[dict[str, Any]], gyms: list[str], simulators: list[str], seed: int = 0):
    """{simulator: {gym or 'overall': (n, mean, lo, hi)}} in UserRL units (x 100)."""
    by: dict[tuple[str, str], list[float]] = {}
    for r in records:
        by.setdefault((r["simulator"], r["gym"]), []).append(r["return"])
    matrix = {}
    for s in simulators:
        row = {}
        for g in gyms:
            v = by.get((s, g), [])
            row[g] = (len(v), *stats.mean_ci(v, seed))
        row["overall"] = (sum(row[g][0] for g in gyms), *stats.overall_ci({g: by.get((s, g), []) for g in gyms}, seed))
        matrix[s] = row
    return matrix


def _cell(m, lo, hi) -> str:
    return f"{m:.1f} [{lo:.1f}, {hi:.1f}]"


def write_matrix(matrix, gyms: list[str], out_dir: str | Path, title: str, prefix: str = "matrix") -> dict[str, Path]:
    from agent_rl.users import short_label

    out = Path(out_dir)
    sims = list(matrix)
    rows = gyms + ["overall"]
    with open(out / f"{prefix}.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["gym", "simulator", "n", "mean", "ci_low", "ci_high"])
        for g in rows:
            for s in sims:
                n, m, lo, hi = matrix[s][g]
                w.writerow([g, s, n, f"{m:.4f}", f"{lo:.4f}", f"{hi:.4f}"])
    lines = [f"# {title}", "", "Score = mean over episodes of the summed turn rewards x 100 (95% bootstrap CI); "
             "overall = mean over gyms.", "",
             "| gym | " + " | ".join(short_label(s) for s in sims) + " |",
             "|---|" + "---|" * len(sims)]
    for g in rows:
        cells = [_cell(*matrix[s][g][1:]) for s in sims]
        name = f"**{g}**" if g == "overall" else g
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Episodes per cell: " + ", ".join(f"{g}={matrix[sims[0]][g][0]}" for g in gyms) + ".")
    (out / f"{prefix}.md").write_text("\n".join(lines) + "\n")
    paths = {"csv": out / f"{prefix}.csv", "md": out / f"{prefix}.md"}
    paths["png"] = _heatmap(matrix, rows, out / ("heatmap.png" if prefix == "matrix" else f"{prefix}_heatmap.png"),
                            title)
    return paths


def _heatmap(matrix, rows, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from agent_rl.users import short_label

    sims = list(matrix)
    data = np.array([[matrix[s][g][1] for s in sims] for g in rows])  # (gyms + 1, simulators)
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(sims), 0.9 + 0.55 * len(rows)))
    im = ax.imshow(np.nan_to_num(data), cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(sims)), [short_label(s) for s in sims], rotation=20, ha="right")
    ax.set_yticks(range(len(rows)), rows)
    for i in range(len(rows)):
        for j in range(len(sims)):
            ax.text(j, i, f"{data[i, j]:.1f}", ha="center", va="center", color="w" if data[i, j] < data.max() * 0.6
                    else "k", fontsize=9)
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, label="score (x100)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def evaluate(args: EvalArgs) -> dict[str, Any]:
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    records = run_agent(args.agent, args)
    matrix = score_matrix(records, args.gym_list, args.simulators, args.seed)
    paths = write_matrix(matrix, args.gym_list, args.out, f"agent {args.agent} on {args.split} tasks")
    return {"matrix": matrix, "paths": {k: str(v) for k, v in paths.items()}, "episodes": len(records)}


@friendly_errors
def main(argv: list[str] | None = None) -> int:
    (args,) = parse_cli((EvalArgs,), argv, prog="python -m agent_rl.evaluate")
    if not args.agent:
        raise DataError("--agent is required")
    res = evaluate(args)
    print(Path(res["paths"]["md"]).read_text())
    print(json.dumps({"episodes": res["episodes"], **res["paths"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
