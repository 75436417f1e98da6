"""The run state that TRL/transformers do not checkpoint, owned by one object, `AdversaryState`: the discriminator,
replay buffer, gate, td curve rows, co-training history, fault counts and the meter's time. Saved into each
`checkpoint-N/mimesis_state/` (from `on_save`, which transformers calls after it has written the generator, optimiser
and its own RNG; or by the rounds objective after each round) and restored by one call, `AdversaryState.load`. The
`COMPLETE` marker is written last, so a checkpoint without it (a kill during the save) is never resumed from."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from adversary.crashpoints import crash_point

if TYPE_CHECKING:
    from adversary.config import AdversaryConfig

STATE_DIR = "mimesis_state"
COMPLETE = "COMPLETE"


class AdversaryState:
    """Everything the adversarial phase carries from step to step besides the generator and its optimiser."""

    def __init__(self, cfg: AdversaryConfig, discriminator, *, max_steps: int | None, seed: int):
        from adversary.config import resolved
        from adversary.cotrain import FaultCounter, ReplayBuffer
        from adversary.gate import PlateauGate

        self.config = resolved(cfg)  # saved with every checkpoint, grouped by part: what the run was
        self.discriminator = discriminator
        self.buffer = ReplayBuffer(size=cfg.replay_size, seed=seed)
        self.gate = PlateauGate(patience=cfg.gate_patience, min_delta=cfg.gate_min_delta, target_td=cfg.gate_target_td,
                                max_steps=max_steps, smooth=cfg.gate_smooth)
        self.faults = FaultCounter(limit=cfg.max_faults)
        self.rows: list[dict] = []  # the td curve, one row per held-out evaluation
        self.cotrain_history: list[dict] = []  # one row per co-training round
        self.collapse_reported = False
        self.meter_seconds = 0.0
        self.rounds_done = 0  # the rounds objective: rounds completed

    @property
    def step(self) -> int:
        return self.rows[-1]["step"] if self.rows else 0

    def state_dict(self) -> dict:
        """Plain data (the discriminator's weights are saved beside it, not in here)."""
        return {"buffer": self.buffer.state_dict(), "gate": self.gate.state_dict(), "rows": self.rows,
                "cotrain": {"history": self.cotrain_history, "collapse_reported": self.collapse_reported},
                "faults": self.faults.counts, "meter_seconds": self.meter_seconds, "rounds_done": self.rounds_done,
                "config": self.config}

    def load_state_dict(self, d: dict) -> None:
        from adversary.gate import PlateauGate

        self.buffer.load_state_dict(d["buffer"])
        self.gate = PlateauGate.from_state_dict(d["gate"])
        self.rows = list(d["rows"])
        self.cotrain_history = list(d.get("cotrain", {}).get("history", []))
        self.collapse_reported = bool(d.get("cotrain", {}).get("collapse_reported", False))
        self.faults.counts = dict(d.get("faults", {}))
        self.meter_seconds = float(d.get("meter_seconds", 0.0))
        self.rounds_done = int(d.get("rounds_done", 0))

    def save(self, checkpoint_dir: str | Path) -> Path:
        return save_state(checkpoint_dir, discriminator=self.discriminator, parts=self.state_dict())

    def load(self, checkpoint_dir: str | Path) -> "AdversaryState":
        self.load_state_dict(load_state(checkpoint_dir, self.discriminator))
        return self


def save_state(checkpoint_dir: str | Path, *, discriminator, parts: dict) -> Path:
    ckpt = Path(checkpoint_dir)
    final = ckpt / STATE_DIR
    tmp = ckpt / (STATE_DIR + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    discriminator.save(tmp / "discriminator")
    crash_point("save")
    doc = dict(parts)
    # our own draws (the replay buffer has its own RNG in `parts`); the Trainer checkpoints torch's RNG itself, the
    # rounds objective relies on these
    doc["rng"] = {"python": random.getstate(), "numpy": _np_state(), "torch": torch.get_rng_state().tolist()}
    (tmp / "state.json").write_text(json.dumps(doc, default=_jsonable))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    (final / COMPLETE).write_text("ok")
    return final


def load_state(checkpoint_dir: str | Path, discriminator) -> dict:
    d = Path(checkpoint_dir) / STATE_DIR
    if not (d / COMPLETE).exists():
        raise FileNotFoundError(f"{d}: no complete run state (interrupted save?)")
    discriminator.load(d / "discriminator")
    doc = json.loads((d / "state.json").read_text())
    rng = doc.pop("rng")
    py = rng["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np.random.set_state(tuple(rng["numpy"]))
    torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))
    return doc


def latest_complete_checkpoint(output_dir: str | Path) -> Path | None:
    """Newest `checkpoint-N` whose run state was written completely."""
    root = Path(output_dir)
    if not root.is_dir():
        return None
    found = []
    for p in root.iterdir():
        m = re.fullmatch(r"checkpoint-(\d+)", p.name)
        if m and (p / STATE_DIR / COMPLETE).exists():
            found.append((int(m.group(1)), p))
    return max(found)[1] if found else None


def _np_state():
    s = np.random.get_state()
    return [s[0], s[1].tolist(), s[2], s[3], s[4]]


def _jsonable(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
