"""GAN overhead: the adversarial GRPO step against a bare TRL GRPO step, same model, batch and lengths, one process.

    python bench/bench_gan_overhead.py            # SmolLM2-135M + MiniLM-L6, the demo's batch and lengths
    python bench/bench_gan_overhead.py --tiny     # tiny random models, a fast check of the benchmark itself

Two GRPOTrainers are built in one process from the demo preset (`--config`): the bare one with a constant reward,
the adversarial one as the main job builds it (`adversary.loop.build_trainer`: `adversary.reward.build_rewards`
with the NeuralDetector, replay buffer, `CoTrainCallback` at the preset's cadence `d_every`/`d_steps`,
FaultGuard), less the held-out meter (measured by bench_default_run.py) and the checkpoint callbacks. The
discriminator gets the job's initial fit first, so its accuracy, and with it the number of co-training updates,
is that of a real run's first steps.

A step is timed from `on_step_begin` to `on_step_end` of a callback registered last (so it includes generation,
rewards, the optimiser step and the co-training update that runs in `on_step_end`). The two trainers run in lock
step: each `train()` runs in its own thread and hands over to the other at the end of every step, so steps
alternate bare, adversarial, bare, ... and neighbouring steps see the same machine load (only one trainer computes
at any time). The first `--warmup` steps of each arm are dropped. Completions are forced to the full
`max_completion_length` (min_new_tokens) so both arms generate and train on exactly the same number of tokens
(`--natural_lengths` turns that off). Co-training runs on one step in `d_every`, so steps are compared over whole
cycles: the measured steps of each arm are cut into consecutive cycles of `d_every` steps (each holds exactly one
co-training step) and a cycle's figure is its mean step time. The ratio is median(adversarial cycle) / median(bare
cycle); `ratio_paired` is the median of the ratios of neighbouring cycles; `ratio_from_components` = 1 / (1 - median
over cycles of the share of an adversarial cycle spent in rewards and co-training), a third estimate that load drift
between steps cannot move. Target: <= 1.10.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, emit, iqr, log, median, r  # noqa: E402

TARGET = 1.10


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"), help="preset whose models, batch and lengths are used")
    p.add_argument("--tiny", action="store_true", help="tiny-random generator and encoder (fast; not the default's numbers)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps per arm, warm-up included (default: warm-up + 3 cycles of d_every steps, 2 with --tiny)")
    p.add_argument("--warmup", type=int, default=2, help="first steps of each arm that are not counted")
    p.add_argument("--disc_init_items", type=int, default=None, help="items of the discriminator's initial fit (default: the preset's)")
    p.add_argument("--natural_lengths", action="store_true", help="let completions stop at end-of-turn (lengths then differ by arm)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    from adversary.train import parse_args, quiet_libraries

    tmp = Path(tempfile.mkdtemp(prefix="bench_gan."))
    overrides = ["--output_dir", str(tmp), "--report_to", "none", "--logging_steps", "100000", "--save_strategy", "no",
                 "--disable_tqdm", "true", "--seed", str(a.seed)]
    if a.tiny:
        overrides += ["--model", "tiny-random", "--discriminator", "tiny-random-encoder"]
    if a.disc_init_items:
        overrides += ["--disc_init_items", str(a.disc_init_items)]
    cfg, args = parse_args(["--config", a.config, *overrides])
    steps = a.steps or a.warmup + (2 if a.tiny else 3) * cfg.d_every
    args.max_steps = steps
    if (steps - a.warmup) < 2 * cfg.d_every:
        p.error(f"need at least 2 measured cycles of d_every={cfg.d_every} steps per arm (--steps minus --warmup)")
    if not a.natural_lengths:
        args.generation_kwargs = {**(args.generation_kwargs or {}), "min_new_tokens": args.max_completion_length}
    quiet_libraries()

    try:
        bare, adv, timers, probes, disc_info = build(cfg, args, a.warmup)
        t0 = time.perf_counter()
        run_lockstep(bare, adv)
        log(f"{2 * steps} steps in {time.perf_counter() - t0:.0f}s")
        for name, t in timers.items():
            log(f"  {name:11s}: " + ", ".join(f"{x:.2f}" for x in t.all))
        samples = {k: t.measured() for k, t in timers.items()}
        cycles = {k: cycle_means(v, cfg.d_every) for k, v in samples.items()}
        med = {k: median(v) for k, v in cycles.items()}
        ratio = med["adversarial"] / med["bare"]
        pairs = [d / b for b, d in zip(cycles["bare"], cycles["adversarial"])]
        comp = probes.per_step()
        shares = probes.cycle_shares(cfg.d_every)
        emit({
            "bench": "gan_overhead",
            "config": str(Path(a.config).resolve().relative_to(ROOT)) if Path(a.config).resolve().is_relative_to(ROOT) else a.config,
            "tiny": a.tiny,
            "model": cfg.model,
            "discriminator": cfg.discriminator,
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "num_generations": args.num_generations,
            "max_completion_length": args.max_completion_length,
            "forced_full_length": not a.natural_lengths,
            "d_every": cfg.d_every,
            "d_steps": cfg.d_steps,
            "steps_per_arm": steps,
            "warmup_steps": a.warmup,
            "samples_per_arm": {k: len(v) for k, v in samples.items()},
            "cycles_per_arm": {k: len(v) for k, v in cycles.items()},
            "step_s_bare": [r(x) for x in samples["bare"]],
            "step_s_adversarial": [r(x) for x in samples["adversarial"]],
            "median_cycle_step_s_bare": r(med["bare"]),
            "median_cycle_step_s_adversarial": r(med["adversarial"]),
            "iqr_cycle_step_s_bare": [r(x) for x in iqr(cycles["bare"])],
            "iqr_cycle_step_s_adversarial": [r(x) for x in iqr(cycles["adversarial"])],
            "ratio": r(ratio),
            "ratio_paired": r(median(pairs)),
            "ratio_pairs": [r(x) for x in pairs],
            # where the extra time goes, per adversarial step (means over the measured steps: co-training is on one
            # step in d_every, so this is its amortised cost)
            "adv_seconds_per_step": {k: r(v) for k, v in comp.items()},
            # insensitive to load drift between steps: within each adversarial cycle, the share of its time spent in
            # the discriminator reward, the other reward terms and co-training; were the rest of the cycle bare
            # steps, the ratio would be 1 / (1 - share)
            "extra_share_median": r(median(shares), 4),
            "ratio_from_components": r(1 / (1 - median(shares))),
            "disc_init": disc_info,
            "disc_updates_per_step": probes.updates,
            "target": TARGET,
            "meets": ratio <= TARGET,
        })
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def run_lockstep(first, second) -> None:
    """Run `first.train()` and `second.train()` in two threads that take turns step by step (first, second, first,
    ...): a Baton callback at the end of each step wakes the other trainer and waits for its own turn."""
    import threading

    from transformers import TrainerCallback

    turn = {id(first): threading.Semaphore(0), id(second): threading.Semaphore(0)}
    errors = []

    class Baton(TrainerCallback):
        def __init__(self, me, other):
            self.me, self.other, self.done = me, other, False

        def on_train_begin(self, args, state, control, **kw):
            turn[self.me].acquire()

        def on_step_end(self, args, state, control, **kw):
            turn[self.other].release()
            turn[self.me].acquire()

        def on_train_end(self, args, state, control, **kw):
            self.done = True
            turn[self.other].release()

    for me, other in ((first, second), (second, first)):
        me.add_callback(Baton(id(me), id(other)))  # after the step timer: the hand-over is not timed

    def target(trainer):
        try:
            trainer.train()
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)
            for sem in turn.values():  # never leave the other thread waiting
                sem.release()
                sem.release()

    threads = [threading.Thread(target=target, args=(t,), daemon=True) for t in (first, second)]
    for t in threads:
        t.start()
    turn[id(first)].release()  # first goes first
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


class StepTimer:
    """Seconds from on_step_begin to on_step_end; the first `warmup` steps are kept apart."""

    def __init__(self, warmup: int):
        self.all: list[float] = []
        self.warmup = warmup
        self._t0 = None

    def callback(self):
        from transformers import TrainerCallback

        timer = self

        class _CB(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                timer._t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                timer.all.append(time.perf_counter() - timer._t0)

        return _CB()

    def measured(self) -> list[float]:
        return self.all[self.warmup:]


class Probes:
    """Wall time inside the discriminator reward, the other reward terms and the co-training callback, per step."""

    def __init__(self):
        self.samples: dict[str, list[float]] = {"disc_reward": [], "other_rewards": [], "cotrain": []}
        self.step: dict[str, float] = {}
        self.updates: list[int] = []
        self.extra: list[float] = []  # per measured step: rewards + co-training seconds
        self.seconds: list[float] = []  # per measured step: the step's seconds

    def add(self, key, dt):
        self.step[key] = self.step.get(key, 0.0) + dt

    def flush(self, measured: bool, step_seconds: float):
        if measured:
            for k in self.samples:
                self.samples[k].append(self.step.get(k, 0.0))
            self.extra.append(sum(self.step.values()))
            self.seconds.append(step_seconds)
        self.step = {}

    def per_step(self) -> dict:
        return {k: sum(v) / len(v) for k, v in self.samples.items() if v}

    def cycle_shares(self, k: int) -> list[float]:
        n = len(self.extra) // k * k
        return [sum(self.extra[i:i + k]) / sum(self.seconds[i:i + k]) for i in range(0, n, k)]


def cycle_means(values: list[float], k: int) -> list[float]:
    """Mean of each run of k consecutive values; an incomplete last run is dropped."""
    return [sum(values[i:i + k]) / k for i in range(0, len(values) // k * k, k)]


def timed_reward(fn, probes: Probes, key: str):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            probes.add(key, time.perf_counter() - t0)

    wrapper.__name__ = fn.__name__
    return wrapper


def build(cfg, args, warmup: int):
    """(bare trainer, adversarial trainer, step timers, probes, discriminator fit info)."""
    import torch
    from transformers import TrainerCallback, set_seed
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOTrainer

    from adversary.cotrain import CoTrainCallback
    from adversary.loop import QuietProgress, build_trainer, grpo_dataset
    from adversary.stages import fit_discriminator, make_discriminator, prepare_data
    from adversary.state import AdversaryState
    from generator.model import load_generator

    set_seed(args.seed)
    data = prepare_data(cfg, args.seed)
    log(f"data: {len(data.train)} train turns; models {cfg.model} + {cfg.discriminator}; "
        f"batch {args.per_device_train_batch_size} x {args.max_completion_length} tokens; torch threads {torch.get_num_threads()}")

    # the adversarial arm, as the main job builds it (less the meter: bench_default_run.py's business), with the
    # job's initial discriminator fit
    model_adv, tok = load_generator(cfg.model, trust_remote_code=args.trust_remote_code)
    state = AdversaryState(cfg, make_discriminator(cfg, args.seed), max_steps=None, seed=args.seed)
    state.faults.limit = 10**9
    t0 = time.perf_counter()
    fit = fit_discriminator(cfg, state.discriminator, model_adv, tok, data, args.seed)
    disc_info = {"items": fit["disc/init_items"], "train_acc": r(fit["disc/init_train_acc"]),
                 "seconds": r(time.perf_counter() - t0, 1)}
    log(f"discriminator: initial fit on {disc_info['items']} items, train acc {disc_info['train_acc']} ({disc_info['seconds']}s)")
    adv_args = copy.deepcopy(args)
    adv = build_trainer(cfg, adv_args, model_adv, tok, state, data)
    adv.remove_callback(QuietProgress)
    cotrain = next(c for c in adv.callback_handler.callbacks if isinstance(c, CoTrainCallback))

    probes = Probes()
    adv.reward_funcs = [timed_reward(f, probes, "disc_reward" if i == 0 else "other_rewards")
                        for i, f in enumerate(adv.reward_funcs)]
    original_on_step_end = cotrain.on_step_end

    def cotrain_timed(args_, state, control, **kw):
        t0 = time.perf_counter()
        out = original_on_step_end(args_, state, control, **kw)
        probes.add("cotrain", time.perf_counter() - t0)
        cotrained = state.global_step % cfg.d_every == 0  # otherwise `last` still holds the previous round's figures
        probes.updates.append(int(cotrain.last.get("disc/updates", 0)) if cotrained else 0)
        return out

    cotrain.on_step_end = cotrain_timed

    # the bare arm: same base weights, LoRA, dataset, batch and lengths; a constant reward, no callbacks of ours
    model_bare, _ = load_generator(cfg.model, trust_remote_code=args.trust_remote_code)

    def constant_reward(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    bare_args = copy.deepcopy(args)
    bare_args.reward_weights = None
    bare = GRPOTrainer(model=model_bare, reward_funcs=[constant_reward], args=bare_args,
                       train_dataset=grpo_dataset(cfg, tok, data.grpo), processing_class=tok,
                       peft_config=cfg.peft_config())

    timers = {"bare": StepTimer(warmup), "adversarial": StepTimer(warmup)}
    for name, trainer in (("bare", bare), ("adversarial", adv)):
        for cb in (ProgressCallback, PrinterCallback):
            trainer.remove_callback(cb)
        trainer.add_callback(timers[name].callback())  # last: its on_step_end runs after the co-training update

    class _Flush(TrainerCallback):  # after the timer: one probe sample per measured adversarial step
        def on_step_end(self, args_, state, control, **kw):
            t = timers["adversarial"]
            probes.flush(measured=len(t.all) > t.warmup, step_seconds=t.all[-1])

    adv.add_callback(_Flush())
    return bare, adv, timers, probes, disc_info


if __name__ == "__main__":
    sys.exit(main())
