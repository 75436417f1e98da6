"""Fault injection for the crash-and-resume tests. `MIMESIS_CRASH_AT=point:n` kills this process with SIGKILL the
n-th time it reaches `point` (generation, disc_update, save, export); `MIMESIS_CRASH_AT=point@s` kills it the first
time it reaches `point` at global step `s` or later (for points whose hit count depends on the run, e.g. discriminator
updates that the accuracy guard rails skip or double). Unset, it costs one dict lookup."""

from __future__ import annotations

import os
import signal

_hits: dict[str, int] = {}


def crash_point(point: str, step: int | None = None) -> None:
    spec = os.environ.get("MIMESIS_CRASH_AT")
    if not spec:
        return
    if "@" in spec:
        name, _, at = spec.partition("@")
        if name == point and step is not None and step >= int(at):
            os.kill(os.getpid(), signal.SIGKILL)
        return
    name, _, n = spec.partition(":")
    if name != point:
        return
    _hits[point] = _hits.get(point, 0) + 1
    if _hits[point] >= int(n or 1):
        os.kill(os.getpid(), signal.SIGKILL)
