"""The run state that TRL/transformers do not checkpoint: discriminator, replay buffer, gate, td curve rows,
co-training history, fault counts and our RNG. Saved into each `checkpoint-N/mimesis_state/` from `on_save`, which
transformers calls after it has written the generator, optimiser and its own RNG; the `COMPLETE` marker is written
last, so a checkpoint without it (a kill during the save) is never resumed from."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from adversary.crashpoints import crash_point

STATE_DIR = "mimesis_state"
COMPLETE = "COMPLETE"


def save_state(checkpoint_dir: str | Path, *, discriminator, parts: dict) -> Path:
    ckpt = Path(checkpoint_dir)
    final = ckpt / STATE_DIR
    tmp = ckpt / (STATE_DIR + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    discriminator.save(tmp / "discriminator")
    crash_point("save")
    doc = dict(parts)
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
