"""UserRL's credit options for multi-turn GRPO: how an episode is scored for the group baseline (trajectory score) and
how that advantage is spread over the agent's turns (turn credit).

- trajectory score `sum`: the sum of turn rewards; `r2g`: the discounted return from the first turn,
  sum_t gamma^t r_t (earlier success scores higher).
- turn credit `equal`: every agent token carries the episode's advantage; `r2g`: turn t's tokens carry it in
  proportion to the discounted reward-to-go G_t = sum_{k>=t} gamma^(k-t) r_k, so turns that lead to reward share more
  of it. Weights are normalised to mean 1 over the turns (the advantage's overall size is kept, as in UserRL), and G_t
  is clipped at 0: a negative weight would flip the sign of the advantage for that turn (reinforcing a turn of a bad
  episode). When no turn has positive reward-to-go the weights fall back to equal, so a below-average episode with no
  reward is still pushed down (UserRL zeroes it instead).
"""

from __future__ import annotations

from typing import Sequence

TURN_CREDITS = ("equal", "r2g")
TRAJECTORY_SCORES = ("sum", "r2g")


def reward_to_go(turn_rewards: Sequence[float], gamma: float) -> list[float]:
    out, running = [0.0] * len(turn_rewards), 0.0
    for t in range(len(turn_rewards) - 1, -1, -1):
        running = turn_rewards[t] + gamma * running
        out[t] = running
    return out


def trajectory_score(turn_rewards: Sequence[float], mode: str = "sum", gamma: float = 0.8) -> float:
    if mode == "sum":
        return float(sum(turn_rewards))
    if mode == "r2g":
        return reward_to_go(turn_rewards, gamma)[0] if turn_rewards else 0.0
    raise ValueError(f"unknown trajectory score '{mode}'; use one of {TRAJECTORY_SCORES}")


def turn_credits(turn_rewards: Sequence[float], mode: str = "equal", gamma: float = 0.8) -> list[float]:
    """One weight per agent turn (mean 1) that multiplies the episode's advantage on that turn's tokens."""
    n = len(turn_rewards)
    if mode == "equal":
        return [1.0] * n
    if mode != "r2g":
        raise ValueError(f"unknown turn credit '{mode}'; use one of {TURN_CREDITS}")
    g = [max(0.0, v) for v in reward_to_go(turn_rewards, gamma)]
    total = sum(g)
    if total <= 1e-12:
        return [1.0] * n
    return [v * n / total for v in g]
