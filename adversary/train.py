"""The main job: train a user simulator against a co-trained discriminator, track the held-out Turing distance,
freeze at a plateau, export the best checkpoint.

    accelerate launch adversary/train.py                          # embedded CPU default: configs/demo.yaml
    accelerate launch adversary/train.py --config configs/smoke.yaml --output_dir runs/smoke
    accelerate launch adversary/train.py --resume_from_checkpoint latest --output_dir runs/demo

Stages: 0. data → 1. SFT warm start → 2. fit discriminator → 3. adversarial GRPO with the discriminator co-trained,
4. held-out td every `eval_steps`, 5. gate → 6. export the best checkpoint (merged weights + hashed manifest).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script (accelerate launch adversary/train.py): make the packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conversations.cli_util import friendly_errors

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


def parse_args(argv):
    from adversary.config import parse_job

    return parse_job((), argv, prog="adversary/train.py", default_config=DEFAULT_CONFIG)


def resolve_resume(args) -> Path | None:
    from adversary.state import latest_complete_checkpoint

    r = args.resume_from_checkpoint
    if not r:
        return None
    if str(r).lower() in ("latest", "true", "last"):
        found = latest_complete_checkpoint(args.output_dir)
        if found is None:
            print(f"no complete checkpoint in {args.output_dir}: starting from scratch")
        return found
    p = Path(r)
    from adversary.state import COMPLETE, STATE_DIR

    if not (p / STATE_DIR / COMPLETE).exists():
        from conversations.schema import DataError

        raise DataError("not a complete checkpoint of this job (no mimesis_state/COMPLETE)", str(p))
    return p


@friendly_errors
def main(argv=None) -> int:
    t_start = time.time()
    cfg, args = parse_args(argv)
    from generator.model import check_vllm

    check_vllm(args.use_vllm)  # before any model loads: one line, not TRL's ImportError from inside the trainer
    quiet_libraries()

    import torch
    from accelerate import PartialState
    from transformers import set_seed

    from adversary.cotrain import FaultCounter, ReplayBuffer
    from adversary.heldout import heldout_settings
    from adversary.gate import PlateauGate
    from adversary.loop import build_trainer
    from adversary.stages import (base_model_td, export_best, fit_discriminator, make_discriminator, prepare_data,
                                  warm_start)
    from adversary.state import load_state
    from conversations.config import to_jsonable
    from generator.model import load_generator

    state = PartialState()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    set_seed(args.seed)
    resume = resolve_resume(args)
    resolved = {"adversary": to_jsonable(cfg), "grpo": to_jsonable(args)}
    if state.is_main_process:
        (out / "config.json").write_text(json.dumps(resolved, indent=2, sort_keys=True))

    # 0. data: real user turns, split by conversation; the held-out contexts are fixed by the seed
    data = prepare_data(cfg, args.seed)
    say(state, f"data: {len(data.train)} train turns, {len(data.heldout)} held-out contexts")

    # (optional) the un-tuned base model's td, the reference point the whole pipeline should beat
    base = base_model_td(cfg, args, data) if resume is None else None
    if base:
        say(state, f"base model {cfg.model}: held-out td {base['td/panel']:.1f} (95% CI {base['td/ci_low']:.1f}-{base['td/ci_high']:.1f})")

    # 1. warm start: SFT on real user turns (skipped when resuming: reuses OUTPUT_DIR/warmstart)
    start_model = warm_start(cfg, args, data)

    # 2. discriminator: fit on real turns against the warm-started generator's (or restored from the checkpoint)
    model, tok = load_generator(start_model, trust_remote_code=args.trust_remote_code)
    disc = make_discriminator(cfg, args.seed)
    gate = PlateauGate(patience=cfg.gate_patience, min_delta=cfg.gate_min_delta, target_td=cfg.gate_target_td,
                       max_steps=args.max_steps if args.max_steps > 0 else None, smooth=cfg.gate_smooth)
    buffer = ReplayBuffer(size=cfg.replay_size, seed=args.seed)
    faults = FaultCounter(limit=cfg.max_faults)
    rows: list = []
    restored = {}
    if resume is not None:
        restored = load_state(resume, disc)
        buffer.load_state_dict(restored["buffer"])
        gate = PlateauGate.from_state_dict(restored["gate"])
        rows = restored["rows"]
        faults.counts = restored["faults"]
        say(state, f"resuming from {resume} (step {rows[-1]['step'] if rows else 0}, {len(rows)} evaluations)")
    else:
        fit = fit_discriminator(cfg, disc, model, tok, data, args.seed)
        say(state, f"discriminator: initial fit on {fit['disc/init_items']} turns, train acc {fit['disc/init_train_acc']:.3f} "
                   f"({fit['disc/init_seconds']:.0f}s)")

    # 3-5. adversarial GRPO; the callbacks co-train the discriminator, measure held-out td and run the gate
    trainer, heldout_cb, cotrain = build_trainer(cfg, args, model, tok, disc, data, gate=gate, rows=rows,
                                                 buffer=buffer, faults=faults)
    if restored:
        cotrain.load_state_dict(restored.get("cotrain", {}))
        heldout_cb.meter_seconds = restored.get("meter_seconds", 0.0)
    if resume is not None and heldout_cb.gate.stopped:
        # the gate froze the generator before this checkpoint was written (or its step budget is spent): training
        # again would run one more step past the freeze; go straight to the export
        say(state, f"the gate already froze the generator ({heldout_cb.gate.reason}): exporting")
    else:
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    gate = heldout_cb.gate
    check_ranks_identical(disc, out, state)
    if faults.exceeded():
        from conversations.schema import DataError

        raise DataError(f"stopped: {faults.total} numerical faults (non-finite rewards, losses or gradients: "
                        f"{faults.counts}) exceed max_faults={cfg.max_faults}; lower the learning rate or reward_clip")

    # 6. export: the best checkpoint by held-out td, not the last one
    best = gate.best
    manifest = {
        "base_model": cfg.model,
        "warm_start": start_model,
        "data": cfg.data,
        "data_fingerprint": data.fingerprint,
        "config": resolved,
        "td_curve": heldout_cb.rows,
        "best": {"step": best.step, "td": best.td, "td_ci95": [best.ci_low, best.ci_high]},
        "gate": {"reason": gate.reason, "description": gate.describe()},
        "base_model_td": base,
        "prompt_format_version": _prompt_version(),
        # what the simulator was measured with; load_simulator and agent_rl.serve default to it
        "sampling": heldout_settings(cfg).to_dict(),
        "precision": cfg.dtype,
        "torch": torch.__version__,
    }
    frozen = export_best(cfg, args, out / "best", manifest)
    wall = time.time() - t_start
    if state.is_main_process:
        first = heldout_cb.rows[0]
        summary = {
            "start_td": round(first["td/panel"], 2),
            "best_td": round(best.td, 2),
            "best_td_ci95": [round(best.ci_low, 2), round(best.ci_high, 2)],
            "best_step": best.step,
            "gate": gate.reason,
            "export": str(frozen),
            "wall_seconds": round(wall, 1),
            "meter_share": round(heldout_cb.meter_seconds / wall, 3),
            "peak_rss_mb": round(_peak_rss_mb(), 1),
        }
        if base:
            summary["base_model_td"] = round(base["td/panel"], 2)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"done: {'base td ' + str(summary['base_model_td']) + ', ' if base else ''}td {summary['start_td']} -> best {summary['best_td']} (95% CI {summary['best_td_ci95'][0]}-"
              f"{summary['best_td_ci95'][1]}) at step {best.step}; gate: {gate.reason}; exported {frozen}; "
              f"{wall / 60:.1f} min")
    return 0


def check_ranks_identical(disc, out: Path, state) -> None:
    """Under several processes, every rank writes the sha256 of its discriminator weights; the main process checks
    that they are all the same (the co-training keeps them identical by broadcasting after each update)."""
    if state.num_processes == 1:
        return
    import hashlib

    h = hashlib.sha256()
    for k, v in sorted(disc.model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    d = out / "disc_ranks"
    d.mkdir(exist_ok=True)
    (d / f"rank{state.process_index}.json").write_text(json.dumps({"sha256": h.hexdigest()}))
    state.wait_for_everyone()
    if state.is_main_process:
        digests = {json.loads(p.read_text())["sha256"] for p in d.glob("rank*.json")}
        print(f"discriminator identical on {state.num_processes} ranks: {'yes' if len(digests) == 1 else 'NO'}")


def quiet_libraries() -> None:
    """Our progress bar and our lines, not every library's: loading bars, dataset-map bars and deprecation notes."""
    import warnings

    import datasets
    import transformers

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def say(state, msg: str) -> None:
    if state.is_main_process:
        print(msg, flush=True)


def _prompt_version() -> str:
    from generator.prompts import PROMPT_FORMAT_VERSION

    return PROMPT_FORMAT_VERSION


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    sys.exit(main())
