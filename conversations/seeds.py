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


# Every other fixed stream of draws, named, in one block: seed = base * scale + offset + index * stride. These formulas
# predate `derive_seed` and feed the pinned figures (the smoke curves, the resume tests, the results pages' readings),
# so their values stay; what changed is that each is written here once, under the name of what it draws.
STREAMS: dict[str, tuple[int, int, int]] = {  # name: (scale, offset, stride)
    "sft_eval_turns": (1, 1, 0),  # generator.sft: which validation turns the warm start's eval reads
    "control_split": (1, 1, 0),  # discriminator.controls: the real-vs-real control's split of conversations
    "gym_split": (1, 1, 0),  # agent_rl.gyms: which tasks are test tasks (the same on every machine)
    "fit_samples": (1, 2, 0),  # the simulated turns of the discriminator's (or the guide's) fit
    "val_split": (1, 5, 0),  # adversary.stages: the validation split's draw
    "study_warm_start": (1, 7, 0),  # adversary.study: the plateau warm start's SFT seed
    "conversation_pick": (1, 11, 0),  # adversary.conversation_meter: which held-out conversations it continues
    "end_calibration": (1, 13, 0),  # adversary.conversation_meter: the contexts the end bias is calibrated on
    "meter_seed": (1, 0, 1000),  # adversary.heldout: the meter's i-th sampling seed (base: HELDOUT_SEED)
    "assistant_call": (1, 0, 1000),  # generator.assistants: the simulated assistant's n-th call
    "round_pass": (1_000_003, 0, 1),  # adversary.rounds: the order of the round's contexts, one per pass
    "dropout_step": (1_000_003, 0, 1),  # discriminator.neural: dropout masks at each step (replayed on resume)
    "plateau_samples": (7_919, 0, 1),  # adversary.objectives: the k-th plateau reading's samples
    "agent_episode": (100_003, 0, 1),  # agent_rl.train: episode i of a GRPO step (base: the step)
}


def seed_for(stream: str, base: int, index: int = 0) -> int:
    """The seed of draw `index` of the named fixed `stream` (STREAMS) in a run seeded with `base`."""
    scale, offset, stride = STREAMS[stream]
    return int(base) * scale + offset + int(index) * stride
