"""Lock-step rollouts: episodes per second with the simulator's replies batched across 8 running episodes, over the
same episodes run one at a time (the simulator then answers one episode per call).

    python bench/bench_rollouts.py [--simulator hf:tiny-random] [--episodes 8] [--max-new-tokens 32] [--threads 0]

A scripted oracle agent (no model: the time is the simulator's) plays intention and travel tasks (3 user turns each).
Prints one JSON line; `speedup` is batched / sequential, target >= 4.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--simulator", default="hf:tiny-random")
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per mode; the best is kept")
    a = p.parse_args(argv)

    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    from agent_rl.agents import ScriptedAgent
    from agent_rl.rollout import RolloutStats, episode_specs, run_episodes
    from agent_rl.users import LMSettings, load_simulator

    half = (a.episodes + 1) // 2
    specs = (episode_specs(["intention"], "train", half) + episode_specs(["travel"], "train", half))[: a.episodes]
    # temperature 0: both modes generate the same number of tokens per reply for the same prompts
    sim = load_simulator(a.simulator, LMSettings(max_new_tokens=a.max_new_tokens, temperature=0.0,
                                                 batch_size=max(1, a.episodes)))
    agent = ScriptedAgent("oracle")
    run_episodes(agent, sim, specs[:2], max_live=2)  # warm-up: first-call costs out of the timings

    def timed(batched: bool):
        best, stats = float("inf"), None
        for _ in range(a.repeats):
            st = RolloutStats()
            t0 = time.perf_counter()
            if batched:
                run_episodes(agent, sim, specs, max_live=a.episodes, stats=st)
            else:
                for s in specs:
                    run_episodes(agent, sim, [s], stats=st)
            dt = time.perf_counter() - t0
            if dt < best:
                best, stats = dt, st
        return best, stats

    t_batch, st_b = timed(True)
    t_seq, st_s = timed(False)
    n = len(specs)
    print(json.dumps({
        "bench": "rollouts",
        "simulator": a.simulator,
        "episodes": n,
        "user_turns": st_b.user_turns,
        "max_new_tokens": a.max_new_tokens,
        "torch_threads": torch.get_num_threads(),
        "batched_eps_per_s": round(n / t_batch, 4),
        "sequential_eps_per_s": round(n / t_seq, 4),
        "batched_simulator_calls": st_b.simulator_calls,
        "sequential_simulator_calls": st_s.simulator_calls,
        "speedup": round(t_seq / t_batch, 2),
        "target": 4.0,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
