"""Filtered behaviour cloning (expert iteration): the agent learns from its own best episodes against a simulator.

    accelerate launch agent_rl/filtered_bc.py --agent_model runs/agent31/sft --simulator scripted:oracle \\
        --gyms intention,travel,persuade --rounds 2 --samples_per_task 4 --output_dir runs/agent-fbc

Each round: the agent plays every train task `samples_per_task` times against the simulator, sampled as a deployed
agent is evaluated (T 0.7, top-p 0.95, 64 new tokens); per task, the episode with the highest return is kept when
that return is above `keep_above` and above the task's worst (a task every sample solves equally teaches nothing
new, one no sample scores on teaches the wrong thing); its agent turns become prompt-completion examples, and TRL's
SFTTrainer trains a LoRA adapter on them on top of the agent (`agent_rl.sft.train`, loss on the completions only).
The next round samples from that adapter (a round that keeps nothing trains nothing, and the next samples from
the same agent). With several simulators (`--simulator scripted:oracle,hf:MODEL`, a mixed round) every train task
is played `samples_per_task` times against each, each simulator's episodes are filtered apart, and one SFT trains on
all that was kept. Before the first round and after each, the agent plays the test tasks
against `eval_simulators` (`eval_repeats` episodes a task, the same seeds every time), read as `agent_rl.curve`
reads GRPO's learning curve: the score with its CI and the paired difference to round 0, in OUTPUT_DIR/curve.jsonl.

Why: GRPO at 8 episodes a step did not raise the held-out score in 96 steps (docs/results.md); this spends the same
rollouts on a lower-variance update (only successes, each cloned). A round's episodes and adapter are kept in
OUTPUT_DIR/round-N: a rerun resumes at the first round without an adapter, and replays none of the episodes that
round already played (ROUND_DIR/kept-I.json, one file a simulator).
"""

from __future__ import annotations

import functools
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a file (accelerate launch): import the package, not its siblings
    _root = str(Path(__file__).resolve().parents[1])
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    sys.path.insert(0, _root)

from conversations.cli_util import friendly_errors  # noqa: E402
from conversations.config import ConfigError, parse_config  # noqa: E402

from agent_rl.sft import AgentSFTArgs  # noqa: E402
from agent_rl.users import UserSamplingArgs  # noqa: E402


@dataclass
class FilteredBCArgs(AgentSFTArgs, UserSamplingArgs):
    simulator: str = field(default="scripted:oracle", metadata={
        "help": "the user simulator the agent trains against; comma-separated for a mixed round: every train task is "
                "played `samples_per_task` times against each, and each simulator's episodes are filtered apart"})
    rounds: int = field(default=2, metadata={"help": "sample, keep the best, clone: this many times"})
    samples_per_task: int = field(default=4, metadata={"help": "episodes per train task per round (seeds differ)"})
    keep_above: float = field(default=0.0, metadata={"help": "an episode is kept only with a return above this"})
    epochs: float = field(default=2.0, metadata={"help": "passes over a round's kept examples (sets max_steps)"})
    eval_simulators: str = field(default="scripted:oracle", metadata={"help": "comma-separated: the curve's users"})
    eval_repeats: int = field(default=3, metadata={"help": "the curve's episodes per test task"})
    eval_gyms: str = field(default="all", metadata={"help": "the curve's gyms (their test tasks), or 'all'"})
    agent_batch_size: int = field(default=48, metadata={"help": "agent turns per engine call"})
    max_live: int = field(default=128, metadata={
        "help": "episodes played at once: as many as the engine's cache budget (2 GiB a side) holds, so that every "
                "episode keeps its agent's and its user's cache between turns and the batches stay full"})

    def __post_init__(self):
        from agent_rl.users import check_simulator_spec
        from conversations.config import check_ranges

        from agent_rl.gyms import resolve_gyms

        super().__post_init__()
        self.eval_gym_list = resolve_gyms(self.eval_gyms)
        check_ranges(self, {"rounds": ">= 1", "samples_per_task": ">= 1", "epochs": "> 0", "eval_repeats": ">= 1",
                            "agent_batch_size": ">= 1", "max_live": ">= 1"})
        self.simulators = self.simulator.split(",")
        if len(set(self.simulators)) != len(self.simulators):
            raise ConfigError(f"simulator: '{self.simulator}' names a simulator twice")
        for spec in [*self.simulators, *self.eval_simulators.split(",")]:
            check_simulator_spec(spec)


def load(agent_spec: str, args: FilteredBCArgs):
    """The agent, sampled as a deployed agent is evaluated (T 0.7, top-p 0.95, 64 new tokens)."""
    from agent_rl.agents import EVAL_TEMPERATURE, EVAL_TOP_P, load_agent
    from agent_rl.curve import EVAL_MAX_NEW_TOKENS

    agent_spec = agent_spec if Path(agent_spec).exists() else f"hf:{agent_spec}"  # a model name: load_agent's form
    return load_agent(agent_spec, seed=0, max_new_tokens=EVAL_MAX_NEW_TOKENS, temperature=EVAL_TEMPERATURE,
                      top_p=EVAL_TOP_P, batch_size=args.agent_batch_size)


def play(agent, args: FilteredBCArgs, simulator: str, split: str, seeds, gyms: list[str]) -> list:
    """`EpisodeResult`s of every task of `gyms`' `split` x `seeds` (spec order) against `simulator`."""
    from agent_rl.rollout import episode_specs, run_episodes
    from agent_rl.users import load_simulator, user_settings

    sim = load_simulator(simulator, user_settings(args), batch_size=args.user_batch_size, seed=0)
    specs = episode_specs(gyms, split, None, seeds, args.max_turns or None)
    # a round against a language-model user runs for tens of minutes: say how far it is, about every tenth
    t0, every, done = time.time(), max(1, len(specs) // 10), 0

    def progress(_i, _result):
        nonlocal done
        done += 1
        if done % every == 0 or done == len(specs):
            print(f"  {split} vs {simulator}: {done}/{len(specs)} episodes ({time.time() - t0:.0f}s)", flush=True)

    results = run_episodes(agent, sim, specs, max_live=args.max_live, on_result=progress)
    for side, who in (("agent", agent), ("user", sim)):  # caches that did not fit were prefilled whole each turn
        store = getattr(who, "kv", None)
        if store is not None and store.budget > 0:
            print(f"  {side} caches: peak {store.peak_bytes / 2**20:.0f} MiB of {store.budget / 2**20:.0f}, "
                  f"{store.dropped} dropped", flush=True)
    return results


def select(results, keep_above: float) -> list:
    """Per task, its best episode when that is above `keep_above` and above the task's worst (first best on ties)."""
    by_task: dict[tuple[str, str], list] = {}
    for r in results:
        by_task.setdefault((r.gym, r.task_id), []).append(r)
    kept = []
    for group in by_task.values():
        best = max(group, key=lambda r: r.total)
        if best.total > keep_above and best.total > min(r.total for r in group):
            kept.append(best)
    return kept


def examples(episodes) -> list[dict]:
    """One {prompt, completion} example per agent turn: the agent's chat up to that turn, and the turn."""
    rows = []
    for ep in episodes:
        for i, m in enumerate(ep.messages):
            if m["role"] == "assistant":
                rows.append({"prompt": [dict(x) for x in ep.messages[:i]], "completion": [dict(m)], "gym": ep.gym})
    return rows


def kept_part(rdir: Path, i: int, simulator: str, seeds, agent: str, args: FilteredBCArgs, policy) -> dict:
    """A round's episodes against the i-th simulator, filtered: what was kept as examples, and the counts. Written to
    ROUND_DIR/kept-i.json as soon as they are played, so a round stopped later (in another user's episodes, in the
    cloning) replays none of them. `policy()`: the round's agent `agent`, loaded once for all its simulators."""
    path = rdir / f"kept-{i}.json"
    if path.exists():
        part = json.loads(path.read_text())
        if part.get("simulator") == simulator and part.get("agent") == agent:
            return part
    results = play(policy(), args, simulator, "train", seeds, args.gym_list)
    best = select(results, args.keep_above)
    part = {"simulator": simulator, "agent": agent, "episodes": len(results),
            "return_sum": sum(r.total for r in results), "tasks_kept": len(best), "rows": examples(best)}
    rdir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(part))
    return part


def run(args: FilteredBCArgs, sft) -> dict:
    import copy
    from dataclasses import replace

    from agent_rl.curve import CURVE_FILE, read_curve, reading
    from agent_rl.sft import train as sft_train

    out = Path(sft.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    curve_path = out / CURVE_FILE
    readings = read_curve(curve_path)
    eval_sims = args.eval_simulators.split(",")
    batch = sft.per_device_train_batch_size * sft.gradient_accumulation_steps

    def read(step: int, agent_spec: str) -> None:
        if any(r["step"] == step for r in readings):
            return
        policy = load(agent_spec, args)
        results = {s: play(policy, args, s, "test", range(args.eval_repeats), args.eval_gym_list) for s in eval_sims}
        rec = {"step": step, "agent": agent_spec,
               "simulators": reading(results, args.eval_gym_list, readings[0]["simulators"] if readings else None)}
        readings.append(rec)
        with open(curve_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        for s, row in rec["simulators"].items():
            print(f"round {step} vs {s}: {row['score']:.1f} [{row['ci'][0]:.1f}, {row['ci'][1]:.1f}], "
                  f"vs round 0 {row.get('vs_start')}", flush=True)

    agent, rounds = args.agent_model, []
    read(0, agent)
    for k in range(1, args.rounds + 1):
        rdir = out / f"round-{k}"
        if (rdir / "round.json").exists():  # resumed: this round is done
            summary = json.loads((rdir / "round.json").read_text())
        else:
            seeds = range((k - 1) * args.samples_per_task, k * args.samples_per_task)  # new seeds every round
            policy = functools.cache(lambda spec=agent: load(spec, args))
            parts = [kept_part(rdir, i, s, seeds, agent, args, policy) for i, s in enumerate(args.simulators)]
            rows = [row for part in parts for row in part["rows"]]
            episodes = sum(p["episodes"] for p in parts)
            summary = {"round": k, "episodes": episodes, "mean_return": sum(p["return_sum"] for p in parts) / episodes,
                       "tasks_kept": sum(p["tasks_kept"] for p in parts), "examples": len(rows)}
            if len(parts) > 1:
                summary["by_simulator"] = {
                    p["simulator"]: {"episodes": p["episodes"], "mean_return": p["return_sum"] / p["episodes"],
                                     "tasks_kept": p["tasks_kept"], "examples": len(p["rows"])} for p in parts}
            if rows:
                round_sft = copy.deepcopy(sft)
                round_sft.output_dir = str(rdir)
                round_sft.max_steps = max(1, math.ceil(args.epochs * len(rows) / batch))
                trained = sft_train(replace(args, agent_model=agent), round_sft, rows=rows)
                summary.update(steps=trained["steps"], train_loss=trained["train_loss"])
            rdir.mkdir(parents=True, exist_ok=True)
            (rdir / "round.json").write_text(json.dumps(summary, indent=2))
            print(json.dumps(summary), flush=True)
        if "steps" in summary:  # the round trained an adapter: the next round samples from it
            agent = str(rdir)
        rounds.append(summary)
        read(k, agent)
    result = {"output_dir": str(out), "rounds": rounds, "curve": readings}
    (out / "filtered_bc.json").write_text(json.dumps(result, indent=2))
    return result


@friendly_errors
def main(argv=None) -> int:
    from trl import SFTConfig

    from conversations.cli_util import start_process
    from conversations.config import given_keys
    from conversations.precision import apply_precision, run_precision
    from generator.sft import SFT_CONFIG_DEFAULTS

    argv = list(sys.argv[1:] if argv is None else argv)
    defaults = {**SFT_CONFIG_DEFAULTS, "max_length": 2048, "per_device_train_batch_size": 4,
                "gradient_accumulation_steps": 2, "logging_steps": 10, "learning_rate": 1e-4,
                "lr_scheduler_type": "constant", "output_dir": "runs/agent-fbc"}
    args, sft = parse_config((FilteredBCArgs, SFTConfig), argv, prog="agent_rl/filtered_bc.py", defaults=defaults)
    start_process()
    args.dtype = run_precision(args.dtype, sft, *given_keys(argv))
    apply_precision(sft, args.dtype)
    print(json.dumps({k: v for k, v in run(args, sft).items() if k != "curve"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
