"""Co-training the discriminator inside the GRPO run.

The reward call only scores and records; the updates happen here, in a `TrainerCallback` at the end of a generator
step, every `d_every` steps: the new (context, simulated, real) triples of every rank are gathered so that the replay
buffer is identical everywhere, the main process makes `d_steps` balanced updates (label smoothing; none while the
discriminator's accuracy on the fresh triples is above the ceiling, twice as many while it is below the floor), and
the weights are broadcast from the main process, so the discriminator stays identical on every rank.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from transformers import TrainerCallback

from adversary.crashpoints import crash_point
from conversations.schema import TurnRecord

if TYPE_CHECKING:
    from adversary.config import AdversaryConfig, DiscriminatorArgs


@dataclass
class ReplayBuffer:
    size: int = 512
    seed: int = 0
    items: deque = field(default_factory=deque)  # (context, simulated_turn, real_turn, id)
    pending: list = field(default_factory=list)  # added on this rank since the last sync

    def __post_init__(self):
        self.items = deque(self.items, maxlen=self.size)
        self.rng = random.Random(self.seed)

    def add(self, sims: list[TurnRecord], reals: list[str]) -> None:
        for s, r in zip(sims, reals):
            self.pending.append((s.context, s.user_turn, r, s.id))

    def take_pending(self) -> list:
        out, self.pending = self.pending, []
        return out

    def extend(self, triples: list) -> None:
        self.items.extend(tuple(t) for t in triples)

    def sample(self, n: int, recent: list | None = None) -> tuple[list[TurnRecord], np.ndarray]:
        """A balanced batch: n/2 simulated turns (the freshest first, then replayed ones) and the real turns of the
        same contexts. Labels: 1 = real, 0 = simulated."""
        half = max(1, n // 2)
        pool = list(recent or [])[:half]
        if len(pool) < half and self.items:
            pool += self.rng.sample(list(self.items), min(half - len(pool), len(self.items)))
        items, labels = [], []
        for ctx, sim, real, rid in pool:
            items.append(TurnRecord(id=f"{rid}", context=ctx, user_turn=sim))
            labels.append(0)
            items.append(TurnRecord(id=f"{rid}@real", context=ctx, user_turn=real))
            labels.append(1)
        return items, np.asarray(labels)

    def state_dict(self) -> dict:
        return {"size": self.size, "items": [list(t) for t in self.items], "rng": self.rng.getstate()}

    def load_state_dict(self, d: dict) -> None:
        self.size = d["size"]
        self.items = deque((tuple(t) for t in d["items"]), maxlen=self.size)
        st = d["rng"]
        self.rng.setstate((st[0], tuple(st[1]), st[2]))


@dataclass
class FaultCounter:
    """Non-finite rewards or losses: each is counted, the step skipped; past `limit` the run stops with a message."""

    limit: int = 5
    counts: dict = field(default_factory=dict)

    def add(self, kind: str, n: int = 1) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + n

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def exceeded(self) -> bool:
        return self.total > self.limit


def broadcast_module(module) -> None:
    """Copy every parameter and buffer of `module` from rank 0 to all ranks (no-op in one process)."""
    import torch.distributed as dist

    if module is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, src=0)


def cotrain_round(cfg: DiscriminatorArgs, state, fresh: list, step: int, *, is_main: bool = True) -> dict:
    """One co-training round on the (context, simulated, real, id) triples `fresh` (the same on every rank): the
    discriminator's accuracy on them before it learns from them, then `d_steps` balanced updates (none while that
    accuracy is above the ceiling, twice as many while it is below the floor; neural updates on the main process,
    broadcast), the classical member refit on every rank. Appends to and returns the round's row."""
    from sklearn.metrics import accuracy_score

    buffer, disc = state.buffer, state.discriminator
    fresh = [tuple(t) for t in fresh]
    items, labels = buffer.sample(2 * len(fresh), recent=fresh) if fresh else ([], np.asarray([]))
    acc = float(accuracy_score(labels, (disc.score(items) > 0).astype(int))) if items else float("nan")
    n_updates = cfg.d_steps
    if acc == acc:  # not NaN
        if acc > cfg.disc_acc_ceiling:
            n_updates = 0
        elif acc < cfg.disc_acc_floor:
            n_updates = 2 * cfg.d_steps
    buffer.extend(fresh)
    losses = []
    if n_updates and items:
        disc.observe(items, labels)  # every rank, deterministic: the classical member stays identical everywhere
    if is_main:
        for i in range(n_updates):
            batch, y = buffer.sample(cfg.disc_batch_size, recent=fresh if i == 0 else None)
            if batch:
                crash_point("disc_update", step=step)
                losses.append(disc.update(batch, y))
    if n_updates:
        broadcast_module(disc.model)
    losses = [x for x in losses if x == x]  # a classical-only discriminator has no loss to report (NaN)
    row = {"step": step, "disc/acc": acc, "disc/loss": float(np.mean(losses)) if losses else None,
           "disc/updates": n_updates, "disc/buffer": len(buffer.items)}
    state.cotrain_history.append(row)
    _check_collapse(state)
    return row


COLLAPSE_WINDOW = 20  # co-training rounds


def _check_collapse(state, window: int | None = None) -> None:
    """A discriminator pinned at 100% (reward saturated) or at 50% (no signal) for many rounds is reported."""
    window = window or COLLAPSE_WINDOW
    recent = [h["disc/acc"] for h in state.cotrain_history[-window:] if h["disc/acc"] == h["disc/acc"]]
    if state.collapse_reported or len(recent) < window:
        return
    if min(recent) >= 0.999 or all(abs(a - 0.5) <= 0.05 for a in recent):
        kind = "pinned at 100%" if min(recent) >= 0.999 else "pinned near 50%"
        print(f"warning: discriminator collapse: accuracy {kind} for {window} update rounds")
        state.cotrain_history[-1]["disc/collapse"] = 1
        state.collapse_reported = True


class CoTrainCallback(TrainerCallback):
    """GRPO's co-training: every `d_every` generator steps, the new triples of every rank are gathered (so the
    replay buffer is identical everywhere) and `cotrain_round` runs."""

    def __init__(self, cfg: AdversaryConfig, state, accelerator=None):
        self.cfg, self.state = cfg, state
        self.accelerator = accelerator  # set once the trainer exists
        self.last: dict = {}

    def on_step_end(self, args, state, control, **kwargs):
        from accelerate.utils import gather_object

        step = state.global_step
        if step % self.cfg.d_every != 0:
            return control
        fresh = self.state.buffer.take_pending()
        if self.accelerator.num_processes > 1:
            fresh = gather_object(fresh)  # every rank now holds every rank's triples, in rank order
        row = cotrain_round(self.cfg, self.state, fresh, step, is_main=self.accelerator.is_main_process)
        self.last = {k: v for k, v in row.items() if k != "step"}
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None:
            logs.update({k: v for k, v in self.last.items() if v is not None})
        return control
