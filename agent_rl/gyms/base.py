"""Gym base: tasks, the hidden goal, the reward hooks, and a Gymnasium-style environment (without gymnasium).

A `Gym` is the task family (its tasks, what the user knows, how each turn is scored). A `GymEnv` runs one episode of it:
`reset(seed=..., task=...) -> observation` and `step(agent_text) -> (observation, reward, terminated, truncated, info)`.
The environment decides when it needs a user turn. For lock-step rollouts across many episodes the step is split in two:
`begin_step(agent_text)` returns a `UserRequest` (or None when no user turn is needed: an answer, an empty message) and
`end_step(user_turn)` finishes the step; `step()` is exactly `begin_step` + one simulator call + `end_step`.

Rewards are computed by code from the exchanged text (keyword / slot matching, parsed tags); each gym's docstring says
what it detects and how.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from conversations import DataError
from conversations.seeds import seed_for

from agent_rl.protocol import PROTOCOL_PROMPT

SPLITS = ("train", "test")
ORACLE, TERSE = "oracle", "terse"


@dataclass(frozen=True)
class Task:
    gym: str
    id: str
    split: str
    opening: str  # the user's first message, which the agent sees
    hidden: dict[str, Any]  # ground truth: for the user (goal) and the reward code only, never shown to the agent

    def key(self) -> str:
        return f"{self.gym}/{self.id}"


@dataclass
class UserRequest:
    """What a user simulator needs to write the next user turn of one episode."""

    context: list[dict[str, str]]  # the dialogue in the agent's point of view (agent = assistant); last is the agent's
    goal: str  # the hidden goal / profile in words, for LM simulators
    gym: str
    task: Task | None  # the structured hidden task, for the rule-based (scripted) users; None outside a gym (serve)
    persona: str | None = None
    episode: int | None = None  # the rollout's key for the episode (an LM user keeps its cache under it); None: none


@dataclass
class EpisodeResult:
    gym: str
    task_id: str
    split: str
    seed: int
    turn_rewards: list[float]
    turns: int
    terminated: bool
    truncated: bool
    max_return: float
    format_errors: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] = field(default_factory=list)  # the agent's side: system, observations, turns
    # the token record of an LM agent that keeps one (agent_rl.agents.EpisodeTokens: ids, env mask, turn of each
    # token), attached when the episode ends, so the episode's text and its tokens travel in one object
    tokens: Any = None

    @property
    def total(self) -> float:
        """The episode's return: the sum of its turn rewards (UserRL's per-episode score, before x100)."""
        return float(sum(self.turn_rewards))

    def to_dict(self) -> dict[str, Any]:
        return {
            "gym": self.gym,
            "task_id": self.task_id,
            "split": self.split,
            "seed": self.seed,
            "turn_rewards": self.turn_rewards,
            "return": self.total,
            "turns": self.turns,
            "terminated": self.terminated,
            "truncated": self.truncated,
            "max_return": self.max_return,
            "format_errors": self.format_errors,
            "info": self.info,
            "messages": self.messages,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EpisodeResult":
        keys = ("gym", "task_id", "split", "seed", "turn_rewards", "turns", "terminated", "truncated", "max_return")
        return cls(
            **{k: d[k] for k in keys},
            format_errors=d.get("format_errors", 0),
            info=d.get("info", {}),
            messages=d.get("messages", []),
        )


class Gym(ABC):
    """One task family. Subclasses set `name`, `max_turns`, `instructions` and implement the hooks below."""

    name: str = ""
    max_turns: int = 6
    instructions: str = ""  # gym-specific rules appended to the agent's system prompt
    seed: int = 0  # task generation seed: the task set and its split are fixed by it
    test_fraction: float = 0.25

    def __init__(self) -> None:
        self._tasks: list[Task] | None = None

    # ---- tasks ------------------------------------------------------------------------------------------------------
    @abstractmethod
    def build_tasks(self, rng: random.Random) -> list[tuple[str, dict[str, Any]]]:
        """Every task instance as (opening, hidden), generated deterministically from `rng`."""

    def tasks(self, split: str | None = None) -> list[Task]:
        if self._tasks is None:
            built = self.build_tasks(random.Random(self.seed))
            # split by a seeded shuffle of the indices: the same tasks are test tasks on every machine and run
            order = list(range(len(built)))
            random.Random(seed_for("gym_split", self.seed)).shuffle(order)
            n_test = max(1, round(len(built) * self.test_fraction))
            test = set(order[:n_test])
            self._tasks = [
                Task(self.name, f"{self.name}-{i:03d}", "test" if i in test else "train", opening, hidden)
                for i, (opening, hidden) in enumerate(built)
            ]
        if split is None:
            return list(self._tasks)
        if split not in SPLITS:
            raise DataError(f"unknown split '{split}'; use one of {SPLITS}")
        return [t for t in self._tasks if t.split == split]

    def get_task(self, task_id: str) -> Task:
        for t in self.tasks():
            if t.id == task_id:
                return t
        raise DataError(f"gym '{self.name}' has no task '{task_id}'")

    def system_prompt(self) -> str:
        return f"{PROTOCOL_PROMPT}\n\n{self.instructions}"

    # ---- the user side ----------------------------------------------------------------------------------------------
    @abstractmethod
    def user_goal(self, task: Task) -> str:
        """The hidden goal in words, given only to the user simulator."""

    @abstractmethod
    def scripted_user(self, task: Task, context: list[dict[str, str]], mode: str) -> str:
        """The rule-based user's next turn (mode ORACLE: truthful and cooperative; TERSE: as little as it can).
        Pure function of the task and the dialogue so far: replaying a dialogue replays the replies."""

    # ---- rewards ----------------------------------------------------------------------------------------------------
    def new_state(self, task: Task) -> dict[str, Any]:
        return {}

    @abstractmethod
    def score_reply(self, task: Task, state: dict, question: str, reply: str) -> tuple[float, bool, dict]:
        """Reward for one [action] turn once the user's reply is in: (reward, terminated, info)."""

    @abstractmethod
    def score_answer(self, task: Task, state: dict, answer: str) -> tuple[float, dict]:
        """Reward for the [answer] turn, which always ends the episode: (reward, info)."""

    @abstractmethod
    def max_return(self, task: Task) -> float:
        """The best achievable sum of turn rewards for this task."""

    # ---- reference agents -------------------------------------------------------------------------------------------
    @abstractmethod
    def oracle_turn(self, task: Task, turn: int) -> str:
        """The privileged reference agent's turn `turn` (0-based): it knows the hidden task and elicits it the way
        the reward code credits, so against the oracle user it scores `max_return`."""

    @abstractmethod
    def random_turn(self, task: Task, rng: random.Random, turn: int) -> str:
        """A baseline agent turn that uses nothing hidden."""
