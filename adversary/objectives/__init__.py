"""The adversarial phase's objectives, behind one interface (`adversary.objectives.base.Objective`).

An objective is one file in this folder: a class that subclasses `Objective` (a whole phase, like GRPO on TRL's
trainer) or `RoundsObjective` (one round at a time: the phase loop owns the rounds, the meter, the gate, the best
checkpoint and resuming) and registers itself with `@register("name")`. `objective: name` in a config selects it;
the file is imported when first asked for, so nothing else changes. A test or a notebook can register one too.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

_REGISTRY: dict[str, type] = {}
_NOT_OBJECTIVES = {"base"}  # modules of this package that hold no objective


def register(name: str):
    """Class decorator: `@register("spin") class Spin(RoundsObjective): ...`."""

    def wrap(cls):
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def available() -> list[str]:
    """Every objective a config may name: the files of this folder and whatever was registered at run time."""
    here = [m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)])]
    return sorted(set(_REGISTRY) | {n for n in here if not n.startswith("_") and n not in _NOT_OBJECTIVES})


def get_objective(name: str) -> type:
    """The objective class registered under `name` (its file imported on first use)."""
    from conversations.config import ConfigError

    if name not in _REGISTRY and name in available():
        importlib.import_module(f"{__name__}.{name}")
    if name not in _REGISTRY:
        raise ConfigError(f"objective: unknown '{name}' (choose from {', '.join(available())})")
    return _REGISTRY[name]


def ignored_keys(name: str, given: set[str]) -> list[str]:
    """Of the keys a user set (`given`), those that only other objectives read: a preset written for GRPO (its
    reward weights, TRL's GRPO keys) run with `objective: dpo_rounds` has them set to no effect, and should say so."""
    reads = set(get_objective(name).owns)
    others = set().union(*(get_objective(o).owns for o in available() if o != name))
    return sorted((others - reads) & set(given))

