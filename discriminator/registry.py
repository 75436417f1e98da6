"""The detector families the meter can cross-fit, by name: `register_detector(name, factory)` adds one,
`make_detector(name, **kw)` builds one fresh. Each factory imports its module when first called, so naming the fast
panel never loads torch."""

from __future__ import annotations

from typing import Any, Callable

from conversations import DataError


def _classical(**kw):
    from discriminator.classical import ClassicalDetector

    return ClassicalDetector(**kw)


def _style(**kw):
    from discriminator.classical import StyleDetector

    return StyleDetector(**kw)


def _neural(**kw):
    from discriminator.neural import NeuralDetector

    return NeuralDetector(**kw)


def _lmjudge(**kw):
    from discriminator.lm_judge import LMJudge

    return LMJudge(**kw)


def _embed(**kw):
    from discriminator.embedding import EmbeddingDetector

    return EmbeddingDetector(**kw)


_REGISTRY: dict[str, Callable[..., Any]] = {"classical": _classical, "style": _style, "neural": _neural,
                                            "embed": _embed, "lmjudge": _lmjudge}


def register_detector(name: str, factory: Callable[..., Any]) -> None:
    """Add a detector family: `factory(seed=..., **kw)` returns an object with `fit(items, labels)` and
    `score(items) -> log-odds of real`."""
    _REGISTRY[name] = factory


def detector_names() -> list[str]:
    return list(_REGISTRY)


def make_detector(name: str, **kw) -> Any:
    if name not in _REGISTRY:
        raise DataError(f"unknown detector {name!r} (choose from {', '.join(_REGISTRY)})")
    return _REGISTRY[name](**kw)


