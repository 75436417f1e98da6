"""The one formula for a seed that must differ per process, per step and per stream of draws.

`derive_seed(base, step=, rank=, stream=)` = base + 1,000,003 * rank + 7,919 * step + 104,729 * stream (primes:
two ranks collide only after 126 steps of difference, which the draws seeded this way, one per step and process,
never compare). Why a sum and not `numpy.random.SeedSequence`: this is the
formula the pinned smoke curves and the resume tests were recorded with (GRPO's rollouts, the agent's rollouts);
SeedSequence would move every pinned figure for no gain in independence that these draws need."""

from __future__ import annotations


def derive_seed(base: int, *, step: int = 0, rank: int = 0, stream: int = 0) -> int:
    """A seed for draw `stream` of process `rank` at `step` of a run seeded with `base`."""
    return int(base) + 1_000_003 * int(rank) + 7_919 * int(step) + 104_729 * int(stream)
