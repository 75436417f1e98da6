"""Lock-step rollouts (agent_rl): episodes per second with the simulator's replies batched across 8 running episodes,
over the same episodes run one at a time, measured in one process run.

    python bench/bench_rollouts.py [--simulator hf:tiny-random] [--episodes 8] [--max-new-tokens 32] [--threads 1]

- batched: `run_episodes(..., max_live=8)`: every round the simulator answers all live episodes in one call;
- sequential: the same episodes one after the other: one simulator call per user turn;
- same work on both sides: a scripted oracle agent (no model, so the time is the simulator's) plays intention and
  travel tasks (3 user turns each, deterministic), greedy user replies (`temperature 0`) of up to `--max-new-tokens`;
- the two modes alternate in ABBA order `--repeats` times after a warm-up; `speedup` is the median of the ratios
  sequential seconds / batched seconds over the rounds, with their IQR. Target >= 4.

On a CPU the ratio depends on what dominates a reply: the tiny random model's decode steps (cheap, per-call
overhead: batching pays) or a real model's prompt prefill (compute-bound: batching saves little; SmolLM2-135M measured
about 1.0 on 2 shared cores). See docs/agent-rl.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, iqr, log, median, r  # noqa: E402

TARGET = 4.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--simulator", default="hf:tiny-random")
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--repeats", type=int, default=2, help="ABBA rounds (each times both modes twice)")
    a = p.parse_args(argv)

    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    from agent_rl.agents import ScriptedAgent
    from agent_rl.rollout import RolloutStats, episode_specs, run_episodes
    from agent_rl.users import load_simulator
    from generator.engine import SamplingSettings

    half = (a.episodes + 1) // 2
    specs = (episode_specs(["intention"], "train", half) + episode_specs(["travel"], "train", half))[: a.episodes]
    sim = load_simulator(a.simulator, SamplingSettings(max_new_tokens=a.max_new_tokens, temperature=0.0,
                                                       max_prompt_tokens=768), batch_size=max(1, a.episodes))
    agent = ScriptedAgent("oracle")
    run_episodes(agent, sim, specs[:2], max_live=2)  # warm-up: first-call costs stay out of the timings

    def timed(batched: bool) -> tuple[float, RolloutStats]:
        st = RolloutStats()
        t0 = time.perf_counter()
        if batched:
            run_episodes(agent, sim, specs, max_live=len(specs), stats=st)
        else:
            for s in specs:
                run_episodes(agent, sim, [s], stats=st)
        return time.perf_counter() - t0, st

    ratios, t_b, t_s = [], [], []
    last: dict[bool, RolloutStats] = {}
    for i in range(a.repeats):
        order = (True, False, False, True) if i % 2 == 0 else (False, True, True, False)  # ABBA, then BAAB
        times: dict[bool, list[float]] = {True: [], False: []}
        for batched in order:
            dt, st = timed(batched)
            times[batched].append(dt)
            last[batched] = st
        tb, ts = sum(times[True]) / 2, sum(times[False]) / 2
        t_b.append(tb)
        t_s.append(ts)
        ratios.append(ts / tb)
        log(f"round {i}: batched {tb:.2f}s, sequential {ts:.2f}s, ratio {ts / tb:.2f}")
    n = len(specs)
    speedup = median(ratios)
    st_batch, st_seq = last[True], last[False]
    emit({
        "bench": "rollouts",
        "simulator": a.simulator,
        "episodes": n,
        "user_turns": st_batch.user_turns,
        "max_new_tokens": a.max_new_tokens,
        "batched_simulator_calls": st_batch.simulator_calls,
        "sequential_simulator_calls": st_seq.simulator_calls,
        "batched_eps_per_s": r(n / median(t_b)),
        "sequential_eps_per_s": r(n / median(t_s)),
        "speedup": r(speedup, 2),
        "speedup_iqr": [r(x, 2) for x in iqr(ratios)],
        "rounds": len(ratios),
        "target": TARGET,
        "target_met": bool(speedup >= TARGET),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
