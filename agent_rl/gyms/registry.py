"""The gym registry: the built-in gyms by name, and gyms registered at run time."""

from __future__ import annotations

from conversations import DataError

from agent_rl.gyms.base import Gym
from agent_rl.gyms.function import FunctionGym
from agent_rl.gyms.intention import IntentionGym
from agent_rl.gyms.persuade import PersuadeGym
from agent_rl.gyms.telepathy import TelepathyGym
from agent_rl.gyms.travel import TravelGym

GYM_CLASSES: dict[str, type[Gym]] = {
    g.name: g for g in (IntentionGym, TelepathyGym, TravelGym, FunctionGym, PersuadeGym)
}
GYM_NAMES = tuple(GYM_CLASSES)  # the built-in gyms; `register_gym` adds more to GYM_CLASSES
_INSTANCES: dict[str, Gym] = {}


def get_gym(name: str) -> Gym:
    """The (shared, stateless) gym of that name; its task list is built once."""
    if name not in GYM_CLASSES:
        raise DataError(f"unknown gym '{name}'; available: {', '.join(GYM_CLASSES)}")
    if name not in _INSTANCES:
        _INSTANCES[name] = GYM_CLASSES[name]()
    return _INSTANCES[name]


def register_gym(cls: type[Gym]) -> type[Gym]:
    """Add a gym class to the registry (usable as a decorator); its `name` must be new."""
    if not cls.name or cls.name in GYM_CLASSES:
        raise DataError(f"gym name '{cls.name}' is empty or already registered")
    GYM_CLASSES[cls.name] = cls
    return cls


def unregister_gym(name: str) -> None:
    GYM_CLASSES.pop(name, None)
    _INSTANCES.pop(name, None)


def resolve_gyms(names) -> list[str]:
    """A list of gym names from a list or a comma-separated string; 'all' or empty means every gym."""
    if isinstance(names, str):
        names = [names]
    out = [n.strip() for item in (names or []) for n in str(item).split(",") if n.strip()]
    if not out or out == ["all"]:
        return list(GYM_NAMES)  # 'all' means the built-in five, not test gyms registered at run time
    for n in out:
        get_gym(n)
    return out
