"""The gyms (task environments), modelled on UserRL's task families, and their registry."""

from __future__ import annotations

from agent_rl.gyms.base import ORACLE, SPLITS, TERSE, EpisodeResult, Gym, Task, UserRequest
from agent_rl.gyms.env import GymEnv
from agent_rl.gyms.registry import GYM_CLASSES, GYM_NAMES, get_gym, register_gym, resolve_gyms, unregister_gym

__all__ = [
    "EpisodeResult", "Gym", "GymEnv", "Task", "UserRequest", "ORACLE", "TERSE", "SPLITS", "GYM_CLASSES", "GYM_NAMES",
    "get_gym", "resolve_gyms", "register_gym", "unregister_gym",
]
