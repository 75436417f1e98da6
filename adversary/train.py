"""The main job: train a user simulator against a co-trained discriminator, track the held-out Turing distance,
freeze at a plateau, export the best checkpoint.

    accelerate launch adversary/train.py                          # embedded CPU default: configs/demo.yaml
    accelerate launch adversary/train.py --config configs/smoke.yaml --output_dir runs/smoke
    accelerate launch adversary/train.py --resume_from_checkpoint latest --output_dir runs/demo

Stages: 0. data → 1. SFT warm start → 2. fit discriminator → 3. the adversarial phase (`objective`, one file each in
adversary/objectives/: dpo_rounds, what configs/demo.yaml selects, spin, resample_sft or grpo) with the
discriminator co-trained, 4. held-out td after every round / every `eval_steps` (the mean of `meter_seeds` sampling seeds), 5. gate → 6. export the best checkpoint (merged weights +
hashed manifest). The thread count is chosen first (`conversations.threads`: a bare `accelerate launch` would leave
one core).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if __package__ in (None, ""):  # run as a script (accelerate launch adversary/train.py): make the packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conversations.cli_util import friendly_errors, quiet_libraries  # noqa: F401 (quiet_libraries: the benches)

if TYPE_CHECKING:
    from adversary.config import ObjectiveArgs

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


def parse_args(argv):
    """(AdversaryConfig, GRPOConfig); a key the user set that the chosen objective does not read is named (a preset
    for GRPO run with objective dpo_rounds would otherwise set its reward weights to no effect, silently)."""
    from adversary.config import parse_job
    from adversary.objectives import ignored_keys
    from adversary.stages import check_recipe
    from conversations.config import given_keys

    argv = list(sys.argv[1:] if argv is None else argv)
    cfg, args = parse_job((), argv, prog="adversary/train.py", default_config=DEFAULT_CONFIG)
    check_recipe(cfg, args)
    given = given_keys(argv if "--config" in argv else ["--config", str(DEFAULT_CONFIG)] + argv)
    ignored = ignored_keys(cfg.objective, set().union(*given))
    if ignored:
        print(f"objective {cfg.objective} does not read {', '.join(ignored)} (set for another objective): no effect",
              file=sys.stderr, flush=True)
    return cfg, args


def resolve_resume(cfg: ObjectiveArgs, args) -> Path | None:
    """The checkpoint to resume from: `--resume_from_checkpoint latest` finds the newest complete one the objective
    wrote (a GRPO `checkpoint-N`, a rounds `round-K`); a path must be a complete checkpoint of this job."""
    from adversary.objectives import get_objective
    from adversary.state import COMPLETE, STATE_DIR
    from conversations.schema import DataError

    r = args.resume_from_checkpoint
    if not r:
        return None
    if str(r).lower() in ("latest", "true", "last"):
        found = get_objective(cfg.objective).latest_checkpoint(Path(args.output_dir))
        if found is None:
            print(f"no complete checkpoint in {args.output_dir}: starting from scratch")
        return found
    if not (Path(r) / STATE_DIR / COMPLETE).exists():
        raise DataError("not a complete checkpoint of this job (no mimesis_state/COMPLETE)", str(r))
    return Path(r)


@friendly_errors
def main(argv=None) -> int:
    t_start = time.time()
    quiet_libraries()  # first: parsing TRL's config already warns about renamed transformers fields
    cfg, args = parse_args(argv)
    from conversations.cli_util import start_process

    threads = start_process(announce=True)  # before any model: accelerate's bare launcher would leave one core of the machine
    from generator.model import check_vllm

    check_vllm(args.use_vllm)  # before any model loads: one line, not TRL's ImportError from inside the trainer
    from accelerate import PartialState
    from transformers import set_seed

    from adversary import stages
    from adversary.card import report_export
    from adversary.heldout import HeldoutMeter
    from adversary.state import AdversaryState
    from generator.model import load_generator

    ps = PartialState()
    out = Path(args.output_dir)
    set_seed(args.seed)
    resume = resolve_resume(cfg, args)
    stages.write_config(cfg, args, out)
    timer = stages.StageTimer()

    # 0. data: every subset the run uses, drawn once (held-out contexts fixed by the seed)
    with timer("data"):
        data = stages.prepare_data(cfg, args.seed)
    ps.print(f"data: {len(data.train)} train turns, {len(data.heldout)} held-out contexts", flush=True)
    # (optional) the un-tuned base model's td: the reference point the whole pipeline should beat
    with timer("base_model"):
        base = stages.base_model_td(cfg, args, data) if resume is None else None
    # 1. warm start: SFT on real user turns (reused from OUTPUT_DIR/warmstart when there)
    with timer("warm_start"):
        start_model = stages.warm_start(cfg, args, data)
        model, tok = load_generator(start_model, trust_remote_code=args.trust_remote_code)
    # 2. the discriminator and the rest of the run state: fitted fresh, or restored from the checkpoint in one call
    with timer("discriminator_fit"):
        state = AdversaryState(cfg, stages.make_discriminator(cfg, args.seed), seed=args.seed,
                               max_steps=args.max_steps if args.max_steps > 0 else None)
        if resume is None:
            stages.fit_discriminator(cfg, state.discriminator, model, tok, data, args.seed)
    # 3-5. the adversarial phase (the config's objective), co-training the discriminator; held-out td and the gate
    with timer("adversarial_phase"):
        meter = HeldoutMeter(cfg, data, tok, state, out)
        stages.adversarial_phase(cfg, args, model, tok, state, data, meter, resume)
    stages.check_ranks_identical(state.discriminator, ps)
    stages.check_faults(cfg, state)
    with timer("best_conversations"):  # conv_readings first_and_best: the best checkpoint's conversation level
        meter.read_best_conversations(out / "best", args.trust_remote_code)
    # 6. export the best checkpoint by held-out td (not the last), then the run's summary
    with timer("export"):
        frozen = stages.export_best(cfg, args, out / "best", stages.manifest(cfg, args, data, state, start_model, base),
                                    data)
    # 7. the export read as its users get it (guide, recorded sampling), its realism report written into it
    with timer("shipped_reading"):
        levels = report_export(cfg, frozen, data, state, base, out)
    stages.write_summary(out, state, base, frozen, t_start, timer, threads=threads.to_dict(), levels=levels)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    sys.exit(main())
