"""Lock-step multi-turn rollouts.

`run_episodes` keeps up to `max_live` episodes running. At each round the agent acts for every live episode in one
batch, each environment parses its agent's tags, and the user simulator answers every episode that needs a user turn in
one batch; finished episodes drop out and queued ones take their places. With an LM simulator, a round costs about one
`generate` of the simulator however many episodes are live, instead of one per episode.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from agent_rl.agents import Agent, EpisodeView
from agent_rl.gyms import EpisodeResult, GymEnv, Task, get_gym


@dataclass(frozen=True)
class EpisodeSpec:
    gym: str
    task: Task
    seed: int = 0
    max_turns: int | None = None  # None: the gym's own turn limit


@dataclass
class RolloutStats:
    rounds: int = 0
    simulator_calls: int = 0
    user_turns: int = 0
    seconds: float = 0.0
    simulator_seconds: float = 0.0
    agent_seconds: float = 0.0
    extra: dict = field(default_factory=dict)


def episode_specs(
    gyms: Sequence[str],
    split: str,
    episodes: int | None = None,
    seeds: Sequence[int] = (0,),
    max_turns: int | None = None,
) -> list[EpisodeSpec]:
    """Specs for each gym's tasks in `split` (the first `episodes` of them when given) x `seeds`."""
    out = []
    for g in gyms:
        tasks = get_gym(g).tasks(split)
        tasks = tasks[:episodes] if episodes else tasks
        out += [EpisodeSpec(g, t, s, max_turns) for s in seeds for t in tasks]
    return out


def run_episodes(
    agent: Agent,
    simulator,
    specs: Sequence[EpisodeSpec],
    *,
    max_live: int | None = None,
    on_result: Callable[[int, EpisodeResult], None] | None = None,
    stats: RolloutStats | None = None,
) -> list[EpisodeResult]:
    """Run every spec to the end, lock-step, at most `max_live` at once (None: all). Results come back in spec order;
    `on_result(index, result)` is called as each episode finishes (for caching)."""
    stats = stats if stats is not None else RolloutStats()
    t0 = time.perf_counter()
    queue = deque(enumerate(specs))
    live: dict[int, tuple[GymEnv, EpisodeSpec]] = {}
    results: list[EpisodeResult | None] = [None] * len(specs)
    while queue or live:
        while queue and (max_live is None or len(live) < max_live):
            i, spec = queue.popleft()
            env = GymEnv(spec.gym, split=spec.task.split, max_turns=spec.max_turns)
            env.reset(seed=spec.seed, task=spec.task)
            live[i] = (env, spec)
        uids = list(live)
        views = []
        for i in uids:
            env, spec = live[i]
            views.append(EpisodeView(uid=i, gym=spec.gym, task=spec.task, turn=env.turn, seed=spec.seed,
                                     messages=env.messages))
        ta = time.perf_counter()
        texts = agent.act(views)  # one batch for all live episodes
        stats.agent_seconds += time.perf_counter() - ta
        need, requests = [], []
        for i, text in zip(uids, texts):
            req = live[i][0].begin_step(text)
            if req is not None:
                req.episode = i
                need.append(i)
                requests.append(req)
        replies: dict[int, str] = {}
        if requests:
            ts = time.perf_counter()
            replies = dict(zip(need, simulator.reply(requests)))  # one batch for all episodes that need a user turn
            stats.simulator_seconds += time.perf_counter() - ts
            stats.simulator_calls += 1
            stats.user_turns += len(requests)
        stats.rounds += 1
        for i in uids:
            env = live[i][0]
            env.end_step(replies.get(i))
            if env.done:
                results[i] = env.result()
                results[i].tokens = agent.end_episode(i)  # an LM agent's token record, when it keeps one
                if hasattr(simulator, "end_episode"):  # an LM user's cache of the episode
                    simulator.end_episode(i)
                del live[i]
                if on_result is not None:
                    on_result(i, results[i])
    stats.seconds += time.perf_counter() - t0
    return results  # type: ignore[return-value]
