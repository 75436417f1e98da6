"""The learning curve of an agent being trained: held-out tasks against fixed simulators, every N GRPO steps.

Each reading plays every test task of the evaluation gyms (`eval_repeats` episodes a task, the same seeds at every
reading, so the readings differ only by the policy) with the policy as it is at that step, sampled as
`agent_rl.evaluate` samples a deployed agent (temperature 0.7, top-p 0.95, 64 new tokens), on the engine's path
(`policy_engine`: a merged copy, the training weights untouched). A reading records, per simulator, the overall
score with its 95% CI, the per-gym scores, the share of tagged agent turns, and the paired difference to the first
reading (step 0: the agent before GRPO) with its CI. Readings are appended to OUTPUT_DIR/curve.jsonl as they are made; a resumed run skips the steps
already there.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from agent_rl import stats
from agent_rl.agents import EVAL_TEMPERATURE, EVAL_TOP_P

log = logging.getLogger("agent_rl.curve")
CURVE_FILE = "curve.jsonl"
EVAL_MAX_NEW_TOKENS = 64  # agent_rl.evaluate's default: the curve reads what the evaluation of a deployed agent reads


def read_curve(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def reading(results_by_sim: dict[str, list], gyms: list[str], start: dict[str, Any] | None, seed: int = 0):
    """One reading from each simulator's episode results (`EpisodeResult`s in spec order). `returns` holds one value
    per task (the mean of its repeats); `start`: the first reading, for the paired difference (same tasks, same
    order)."""
    out = {}
    for sim, results in results_by_sim.items():
        per_task: dict[str, dict[str, list[float]]] = {g: {} for g in gyms}
        for r in results:
            per_task[r.gym].setdefault(r.task_id, []).append(r.total)
        # one value per task (the mean of its repeats), in task order: the CIs and the pairing are over tasks
        per_gym = {g: [sum(v) / len(v) for v in per_task[g].values()] for g in gyms}
        score, lo, hi = stats.overall_ci(per_gym, seed)
        turns = sum(r.turns for r in results)
        row = {
            "score": round(score, 2), "ci": [round(lo, 2), round(hi, 2)], "episodes": len(results),
            "tasks": sum(len(v) for v in per_gym.values()),
            "by_gym": {g: round(stats.SCALE * sum(v) / len(v), 2) for g, v in per_gym.items() if v},
            "format_ok": round(1.0 - sum(r.format_errors for r in results) / max(1, turns), 4),
            "returns": per_gym,
        }
        if start is not None and sim in start:
            pairs = {g: (start[sim]["returns"][g], per_gym[g]) for g in gyms}
            d, dlo, dhi = stats.paired_delta_ci(pairs, seed)
            row["vs_start"] = [round(d, 2), round(dlo, 2), round(dhi, 2)]
        out[sim] = row
    return out


def curve_callback(args, tokenizer, output_dir: str):
    """A `TrainerCallback` that makes a reading before the first step, every `args.eval_every` steps and after the
    last; `args` is `AgentRLArgs` (eval_every, eval_simulators, eval_gyms, eval_tasks_per_gym, dtype, ...)."""
    from transformers import TrainerCallback

    from agent_rl.agents import PolicyAgent
    from agent_rl.rollout import episode_specs, run_episodes
    from agent_rl.users import load_simulator, user_settings
    from generator.engine import policy_engine

    gyms = args.eval_gym_list
    sims = {s: load_simulator(s, user_settings(args), batch_size=args.user_batch_size, seed=0)
            for s in args.eval_simulators.split(",")}
    specs = episode_specs(gyms, "test", args.eval_tasks_per_gym or None, range(args.eval_repeats),
                          args.max_turns or None)
    path = Path(output_dir) / CURVE_FILE

    class HeldOutCurve(TrainerCallback):
        def __init__(self):
            self.readings = read_curve(path)

        def _read(self, state, model):
            step = state.global_step
            if not state.is_world_process_zero or any(r["step"] == step for r in self.readings):
                return
            t0 = time.perf_counter()
            results = {}
            with policy_engine(model, tokenizer, precision=args.dtype, batch_size=len(specs),
                               merge_lora=True) as engine:
                for name, sim in sims.items():
                    agent = PolicyAgent(engine.model, tokenizer, engine=engine, max_new_tokens=EVAL_MAX_NEW_TOKENS,
                                        temperature=EVAL_TEMPERATURE, top_p=EVAL_TOP_P, max_seq_len=args.max_seq_len,
                                        seed=0)
                    results[name] = run_episodes(agent, sim, specs)
            start = self.readings[0]["simulators"] if self.readings else None
            rec = {"step": step, "simulators": reading(results, gyms, start),
                   "seconds": round(time.perf_counter() - t0, 1)}
            self.readings.append(rec)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            for name, row in rec["simulators"].items():
                log.info("curve step %d vs %s: %.1f [%.1f, %.1f], format %.2f, vs start %s (%.0f s)", step, name,
                         row["score"], *row["ci"], row["format_ok"], row.get("vs_start"), rec["seconds"])

        def on_train_begin(self, targs, state, control, model=None, **kw):
            self._read(state, model)

        def on_step_end(self, targs, state, control, model=None, **kw):
            if state.global_step % args.eval_every == 0 or state.global_step >= state.max_steps:
                self._read(state, model)

    return HeldOutCurve()


def curve_table(runs: dict[str, list[dict[str, Any]]]) -> str:
    """A markdown table: one row per (run, step, simulator) with the score, its CI, the difference to step 0 and the
    share of tagged agent turns."""
    lines = ["| run | step | simulator | score [95% CI] | vs step 0 [paired 95% CI] | tagged turns |",
             "|---|---|---|---|---|---|"]
    for name, readings in runs.items():
        for r in readings:
            for sim, row in r["simulators"].items():
                d = row.get("vs_start")
                vs = f"{d[0]:+.1f} [{d[1]:+.1f}, {d[2]:+.1f}]" if d else ""
                lines.append(f"| {name} | {r['step']} | {sim} | {row['score']:.1f} [{row['ci'][0]:.1f}, "
                             f"{row['ci'][1]:.1f}] | {vs} | {row['format_ok']:.2f} |")
    return "\n".join(lines) + "\n"


def plot_curves(runs: dict[str, list[dict[str, Any]]], path: str | Path) -> Path:
    """Score (with its CI band) and tagged-turn share against the GRPO step, one line per (run, simulator)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for name, readings in runs.items():
        sims = list(readings[0]["simulators"]) if readings else []
        for sim in sims:
            steps = [r["step"] for r in readings]
            rows = [r["simulators"][sim] for r in readings]
            line, = ax.plot(steps, [x["score"] for x in rows], marker="o", label=f"{name} vs {sim}")
            ax.fill_between(steps, [x["ci"][0] for x in rows], [x["ci"][1] for x in rows], alpha=0.15,
                            color=line.get_color())
            bx.plot(steps, [x["format_ok"] for x in rows], marker="o", color=line.get_color())
    xlabel = "GRPO step, or filtered-BC round"
    ax.set(xlabel=xlabel, ylabel="score on the test tasks (x100)", title="held-out return")
    bx.set(xlabel=xlabel, ylabel="share of tagged agent turns", title="format", ylim=(0, 1.05))
    for axis in (ax, bx):  # steps and rounds are whole numbers
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def main(argv: list[str] | None = None) -> int:
    """python -m agent_rl.curve NAME=RUN_DIR ... --out FILE.png: the runs' curves as a figure, the table printed."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m agent_rl.curve", description=main.__doc__)
    p.add_argument("runs", nargs="+", help="NAME=RUN_DIR (a run of agent_rl/train.py with --eval_every)")
    p.add_argument("--out", required=True, help="the figure (.png)")
    a = p.parse_args(argv)
    runs = {}
    for spec in a.runs:
        name, sep, d = spec.partition("=")
        path = Path(d if sep else name) / CURVE_FILE
        runs[name] = read_curve(path)
        if not runs[name]:
            p.error(f"{path}: no readings (was the run given --eval_every?)")
    plot_curves(runs, a.out)
    print(curve_table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
