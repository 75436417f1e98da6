"""One episode at a time of one gym, gymnasium-style (`reset`, `step`)."""

from __future__ import annotations

import copy
from typing import Any

from conversations import DataError

from agent_rl.gyms.base import EpisodeResult, Gym, Task, UserRequest
from agent_rl.protocol import ANSWER, parse_agent_text
from agent_rl.gyms.registry import get_gym


class GymEnv:
    """One episode at a time of one gym. `simulator` is needed only for `step()` (lock-step rollouts call
    `begin_step` / `end_step` themselves and batch the simulator across episodes)."""

    def __init__(self, gym: Gym | str, simulator=None, *, split: str = "train", max_turns: int | None = None):
        if isinstance(gym, str):
            gym = get_gym(gym)
        self.gym = gym
        self.max_turns = max_turns or gym.max_turns  # the turn limit: a step at this turn count is truncated
        self.simulator = simulator
        self.split = split
        self.task: Task | None = None
        self.done = True

    # ---- gymnasium-style API ----------------------------------------------------------------------------------------
    def reset(self, seed: int | None = None, task: Task | str | None = None) -> str:
        if task is None:
            pool = self.gym.tasks(self.split)
            task = pool[(seed or 0) % len(pool)]
        elif isinstance(task, str):
            task = self.gym.get_task(task)
        self.task = task
        self.seed = int(seed or 0)
        self.state = self.gym.new_state(task)
        self.turn = 0
        self.turn_rewards: list[float] = []
        self.format_errors = 0
        self.terminated = self.truncated = False
        self.done = False
        self.info: dict[str, Any] = {}
        self.messages = [
            {"role": "system", "content": self.gym.system_prompt()},
            {"role": "user", "content": task.opening},
        ]
        self.dialogue = [{"role": "user", "content": task.opening}]  # what the user simulator sees, agent POV
        self._pending: tuple[str, float, bool, dict] | None = None
        self._question: str | None = None
        return task.opening

    def step(self, agent_text: str):
        request = self.begin_step(agent_text)
        reply = None
        if request is not None:
            if self.simulator is None:
                raise DataError("this step needs a user turn: create GymEnv(..., simulator=load_simulator(...))")
            reply = self.simulator.reply([request])[0]
        return self.end_step(reply)

    # ---- the two halves of a step -----------------------------------------------------------------------------------
    def begin_step(self, agent_text: str) -> UserRequest | None:
        if self.done:
            raise DataError("step() on a finished episode; call reset() first")
        if self._pending is not None or self._question is not None:
            raise DataError("begin_step() twice without end_step()")
        move = parse_agent_text(agent_text)
        self.turn += 1
        self.format_errors += 0 if move.well_formed else 1
        self.messages.append({"role": "assistant", "content": agent_text})
        if move.kind == ANSWER:
            reward, info = self.gym.score_answer(self.task, self.state, move.content)
            self._pending = ("[env] Your answer was recorded. The conversation is over.", reward, True, info)
            return None
        if not move.content:
            obs = "[env] Your message was empty. Reply with [action] <message> or [answer] <answer>."
            self._pending = (obs, 0.0, False, {"empty_action": True})
            return None
        self._question = move.content
        self.dialogue.append({"role": "assistant", "content": move.content})
        return UserRequest(
            context=copy.deepcopy(self.dialogue), goal=self.gym.user_goal(self.task), gym=self.gym.name, task=self.task
        )

    def end_step(self, user_turn: str | None = None):
        if self._pending is not None:
            obs, reward, terminated, info = self._pending
        else:
            if self._question is None:
                raise DataError("end_step() without begin_step()")
            if user_turn is None:
                raise DataError("this step asked for a user turn; pass the simulator's reply to end_step()")
            obs = user_turn
            self.dialogue.append({"role": "user", "content": user_turn})
            reward, terminated, info = self.gym.score_reply(self.task, self.state, self._question, user_turn)
        self._pending = self._question = None
        self.messages.append({"role": "user", "content": obs})
        self.turn_rewards.append(float(reward))
        self.terminated = bool(terminated)
        self.truncated = not self.terminated and self.turn >= self.max_turns
        self.done = self.terminated or self.truncated
        self.info = {**info, "turn": self.turn}
        return obs, float(reward), self.terminated, self.truncated, dict(self.info)

    def result(self) -> EpisodeResult:
        return EpisodeResult(
            gym=self.gym.name,
            task_id=self.task.id,
            split=self.task.split,
            seed=self.seed,
            turn_rewards=list(self.turn_rewards),
            turns=self.turn,
            terminated=self.terminated,
            truncated=self.truncated,
            max_return=self.gym.max_return(self.task),
            format_errors=self.format_errors,
            info={k: v for k, v in self.state.items() if _jsonable(v)},
            messages=copy.deepcopy(self.messages),
        )


def _jsonable(v: Any) -> bool:
    return isinstance(v, (str, int, float, bool, list, dict, type(None)))
