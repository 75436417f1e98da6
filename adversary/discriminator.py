"""The discriminator the generator is trained against (as opposed to the meter's fresh detectors).

An ensemble of two families, averaged in log-odds of "real":
- `neural`: the pair classifier over (context tail, user turn) (`discriminator.neural.NeuralDetector`, MiniLM by
  default), fitted on thousands of turns before the adversarial phase and then updated online, one optimiser step
  at a time, from the co-training rounds;
- `classical`: character and word n-gram TF-IDF + style features into logistic regression
  (`discriminator.classical.ClassicalDetector`), refit from scratch on a bounded pool of every labelled turn it has
  seen (the newest `pool_size`): it fits 2,000 turns in about a second here and catches the surface statistics
  (length, punctuation, phrasing) that a generator learns first, so the judge stays ahead of the generator.

`weights` mixes them; a weight of 0 leaves a member out. Every process of a distributed run holds the same
ensemble: the classical refit is deterministic and runs on every rank from the same pool; the neural updates run on
the main process and are broadcast (adversary.cotrain).
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Sequence

import numpy as np

from conversations import DataError, TurnRecord


def with_end(text: str, ended: bool, on: bool) -> str:
    """The discriminator's view of a turn: with `disc_sees_end` (`on`), a turn that ends its conversation (a real
    user's last turn, a simulated turn that wrote the end marker) carries the marker, so ending is part of what the
    discriminator compares: a real user who ended against a simulator that went on, and the reverse."""
    from generator.prompts import END_MARKER

    return f"{text} {END_MARKER}" if on and ended else text


class Discriminator:
    def __init__(self, neural=None, *, classical: bool = True, weights: tuple[float, float] = (1.0, 1.0),
                 pool_size: int = 4096, seed: int = 0):
        if neural is None and not classical:
            raise DataError("the discriminator needs at least one member (neural or classical)")
        self.neural = neural if weights[0] > 0 else None
        self.use_classical = bool(classical and weights[1] > 0)
        self.weights = (float(weights[0]) if self.neural is not None else 0.0,
                        float(weights[1]) if self.use_classical else 0.0)
        self.pool_size, self.seed = pool_size, seed
        self.pool: deque = deque(maxlen=pool_size)  # (TurnRecord, label)
        self.classical = None

    @property
    def model(self):
        """The neural member's torch module (broadcast across ranks, hashed to check they agree); None without it."""
        return self.neural.model if self.neural is not None else None

    # ----------------------------------------------------------------------------------------------------- training
    def fit(self, items: Sequence[TurnRecord], labels, epochs: int = 1) -> "Discriminator":
        """The initial fit: the neural member for `epochs`, the classical one on these items."""
        y = np.asarray(labels)
        if self.neural is not None:
            self.neural.fit(items, y, epochs=epochs)
        self.observe(items, y)
        return self

    def observe(self, items: Sequence[TurnRecord], labels) -> None:
        """Add labelled turns to the classical member's pool and refit it (every rank; deterministic)."""
        if not self.use_classical or not len(items):
            return
        self.pool.extend(zip(items, np.asarray(labels).tolist()))
        self._refit()

    def _refit(self) -> None:
        from discriminator.classical import ClassicalDetector

        items = [it for it, _ in self.pool]
        y = np.asarray([lab for _, lab in self.pool])
        if len(np.unique(y)) < 2:
            return
        self.classical = ClassicalDetector(seed=self.seed).fit(items, y)

    def update(self, items: Sequence[TurnRecord], labels) -> float:
        """One optimiser step of the neural member (the main process of a distributed run); returns its loss."""
        if self.neural is None:
            return float("nan")
        return float(self.neural.update(items, labels))

    # ------------------------------------------------------------------------------------------------------ scoring
    def member_scores(self, items: Sequence[TurnRecord]) -> dict[str, np.ndarray]:
        out = {}
        if self.neural is not None:
            out["neural"] = np.asarray(self.neural.score(items), dtype=np.float64)
        if self.use_classical and self.classical is not None:
            out["classical"] = np.asarray(self.classical.score(items), dtype=np.float64)
        return out

    def score(self, items: Sequence[TurnRecord]) -> np.ndarray:
        """Log-odds that each item is real [n]: the weighted mean of the members' log-odds."""
        if not len(items):
            return np.zeros(0)
        parts = self.member_scores(items)
        w = {"neural": self.weights[0], "classical": self.weights[1]}
        total = sum(w[k] for k in parts)
        if not parts or total == 0:
            raise DataError("the discriminator is not fitted yet")
        return sum(w[k] * v for k, v in parts.items()) / total

    def fingerprint(self) -> str:
        """sha256 of the neural weights and the classical member's coefficients: equal on every rank of a run."""
        import hashlib

        h = hashlib.sha256()
        if self.neural is not None:
            for k, v in sorted(self.neural.model.state_dict().items()):
                h.update(k.encode())
                h.update(v.detach().cpu().float().contiguous().numpy().tobytes())
        if self.classical is not None:
            lr = self.classical._model
            h.update(np.ascontiguousarray(lr.coef_, dtype=np.float64).tobytes())
            h.update(np.ascontiguousarray(lr.intercept_, dtype=np.float64).tobytes())
        return h.hexdigest()

    # -------------------------------------------------------------------------------------------------------- state
    def save(self, directory: str | Path) -> Path:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        if self.neural is not None:
            self.neural.save(d / "neural")
        pool = [{"item": it.to_dict(), "label": int(lab)} for it, lab in self.pool]
        (d / "ensemble.json").write_text(json.dumps({"weights": self.weights, "pool_size": self.pool_size,
                                                     "seed": self.seed, "pool": pool}))
        return d

    def load(self, directory: str | Path) -> "Discriminator":
        """Restore in place; the classical member is refit from the saved pool (deterministic, so identical)."""
        d = Path(directory)
        if self.neural is not None:
            self.neural.load(d / "neural")
        self._restore_pool(json.loads((d / "ensemble.json").read_text()))
        return self

    def _restore_pool(self, doc: dict) -> None:
        self.pool = deque(((TurnRecord.from_dict(p["item"]), p["label"]) for p in doc["pool"]), maxlen=self.pool_size)
        if self.use_classical and self.pool:
            self._refit()

    @classmethod
    def from_saved(cls, directory: str | Path) -> "Discriminator":
        """A discriminator built from what `save` wrote (members, weights, pool size, seed), each file read once."""
        d = Path(directory)
        doc = json.loads((d / "ensemble.json").read_text())
        neural = None
        if doc["weights"][0] > 0:
            import discriminator.lm_judge  # noqa: F401 (a saved judge loads as one: NeuralDetector.families)
            from discriminator.neural import NeuralDetector

            neural = NeuralDetector.load(d / "neural")
        disc = cls(neural, classical=doc["weights"][1] > 0, weights=tuple(doc["weights"]), pool_size=doc["pool_size"],
                   seed=doc["seed"])
        disc._restore_pool(doc)
        return disc
