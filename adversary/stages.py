"""The stages of the main job, each a small function that `adversary/train.py` calls in order."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from conversations.fingerprint import fingerprint
from conversations.memory import peak_rss_mb, release_memory
from conversations.schema import TurnRecord
from conversations.seeds import seed_for
from generator.data import load_turns, sample_records

if TYPE_CHECKING:
    from adversary.config import AdversaryConfig, ObjectiveArgs

log = logging.getLogger("adversary")


@dataclass
class RunData:
    """Every sample of real turns a run uses, drawn once in `prepare_data`. The train-split subsets are disjoint."""

    train: list[TurnRecord]  # the whole train split (after the length filter)
    warmstart: list[TurnRecord]  # SFT warm start turns
    disc_fit: list[TurnRecord]  # contexts of the discriminator's initial fit; their real turns are its positives
    grpo: list[TurnRecord]  # contexts of the adversarial phase (GRPO prompts, the rounds' contexts)
    rest: list[TurnRecord]  # the train turns none of the above uses, in a seeded order (continued SFT draws here)
    heldout: list[TurnRecord]  # test split: the meter's fixed contexts, never trained on
    val: list[TurnRecord]  # val split: choices made before the test split is looked at (temperature, plateau)
    fingerprint: str
    heldout_convs: list = field(default_factory=list)  # test split: whole conversations the meter continues (conv_contexts)
    end_contexts: list = field(default_factory=list)  # train: contexts the calibrated end decision is solved on
    real_end_rate: float | None = None  # train: real users' end rate per turn inside the conversation window


def check_recipe(cfg: ObjectiveArgs, args) -> None:
    """An objective with a recipe of its own (a `check_config(cfg, args)` classmethod: turing_grpo) checks it when the
    config is parsed, before any model loads: a broken recipe is one line naming the keys, not an error after the
    warm start."""
    from adversary.objectives import get_objective

    check = getattr(get_objective(cfg.objective), "check_config", None)
    if check is not None:
        check(cfg, args)


def prepare_data(cfg: AdversaryConfig, seed: int, *, val_contexts: int = 0) -> RunData:
    """Real user turns, split by conversation (no conversation in two splits). Every subset the run uses is drawn
    here, with its seed derived in this one block: the train split is shuffled once (seed) and cut into the warm
    start's turns, the discriminator-fit contexts and the adversarial contexts; the held-out contexts (test split)
    and the validation contexts (val split) are sampled with their own seeds, so changing a train-side size never
    moves the meter's contexts."""
    import random

    from conversations.schema import DataError

    seeds = {"train_order": seed, "heldout": seed, "val": seed_for("val_split", seed)}
    kw = dict(max_context_messages=cfg.max_context_messages, max_turn_chars=cfg.max_turn_chars)
    train = [r for r in load_turns(cfg.data, "train", **kw) if r.user_turn.strip()]
    test = [r for r in load_turns(cfg.data, "test", **kw) if r.user_turn.strip()]
    heldout = sample_records(test, cfg.heldout_contexts, seed=seeds["heldout"])
    if len(heldout) < 20:
        raise DataError(f"only {len(heldout)} held-out turns in the test split; the meter needs at least 20", cfg.data)
    val = []
    if val_contexts:
        val = sample_records([r for r in load_turns(cfg.data, "val", **kw) if r.user_turn.strip()], val_contexts,
                             seed=seeds["val"])
    order = random.Random(seeds["train_order"]).sample(range(len(train)), len(train))
    sizes = {"warmstart": cfg.warmstart_steps * cfg.warmstart_batch_size, "disc_fit": cfg.disc_init_items,
             "grpo": cfg.train_contexts}
    cut, at = {}, 0
    for name, n in sizes.items():
        cut[name] = [train[i] for i in sorted(order[at:at + n])]
        at += n
    if at > len(train):
        raise DataError(f"the train split has {len(train)} turns, fewer than the run draws ({sizes}); lower "
                        "warmstart_steps, disc_init_items or train_contexts", cfg.data)
    rest = [train[i] for i in order[at:]]
    from adversary.conversation_meter import end_calibration, heldout_conversations

    end_contexts, real_end_rate = end_calibration(cfg, rest, seeds["train_order"])
    return RunData(train=train, rest=rest, heldout=heldout, val=val, fingerprint=fingerprint(train + heldout),
                   heldout_convs=heldout_conversations(cfg, seeds["heldout"]), end_contexts=end_contexts,
                   real_end_rate=real_end_rate, **cut)


def base_model_td(cfg: AdversaryConfig, args, data: RunData) -> dict | None:
    """The un-tuned base model's held-out td, for comparison (main process; `eval_base_model`)."""
    from accelerate import PartialState

    from adversary.heldout import measure_heldout, simulate_heldout
    from generator.model import load_generator

    if not cfg.eval_base_model or not PartialState().is_main_process:
        return None
    from conversations.precision import inference_dtype

    model, tok = load_generator(cfg.model, trust_remote_code=args.trust_remote_code, dtype=inference_dtype(cfg.dtype))
    sims = simulate_heldout(model, tok, data.heldout, cfg, precision=cfg.dtype)  # the meter's fixed sampling seed
    del model
    row = measure_heldout(data.heldout, sims, cfg)
    print(f"base model {cfg.model}: held-out td {row['td/panel']:.1f} (95% CI {row['td/ci_low']:.1f}-"
          f"{row['td/ci_high']:.1f})", flush=True)
    return {k: v for k, v in row.items() if k.startswith(("td/", "diag/len_ratio", "diag/assistant", "diag/end"))}


# ------------------------------------------------------------------------------------------------------ 1. warm start


def warm_start_config(cfg: AdversaryConfig, args, out: Path, steps: int, seed: int, lr_scheduler_type: str = "cosine",
                      **sft_fields):
    """(SFTArgs, SFTConfig) of SFT on real user turns with the main job's settings: the warm start, and the study's
    continued-SFT arm and plateau run (`sft_fields` override SFTArgs fields)."""
    from generator.sft import SFTArgs, sft_config

    sft_args = SFTArgs(model=cfg.model, lora_r=cfg.lora_r or 16, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                       max_context_messages=cfg.max_context_messages, max_context_tokens=cfg.max_context_tokens,
                       max_turn_chars=cfg.max_turn_chars, eval_turns=0, save_adapter=False, save_merged=True,
                       dtype=cfg.dtype, loss=cfg.sft_loss, tailr_gamma=cfg.tailr_gamma,
                       mixce_eta=cfg.mixce_eta, **sft_fields)
    config = sft_config(output_dir=str(out), max_steps=steps, per_device_train_batch_size=cfg.warmstart_micro_batch,
                        gradient_accumulation_steps=cfg.warmstart_batch_size // cfg.warmstart_micro_batch,
                        learning_rate=cfg.warmstart_lr, lr_scheduler_type=lr_scheduler_type,
                        max_length=cfg.warmstart_max_length, seed=seed, trust_remote_code=args.trust_remote_code)
    return sft_args, config


def warm_start(cfg: AdversaryConfig, args, data: RunData) -> str:
    """SFT on real user turns (loss on the user side only, LoRA), merged into plain weights under
    OUTPUT_DIR/warmstart; reused when already there (a resumed run does not repeat it). Returns the model path."""
    from conversations.assets import resolve_model

    if cfg.warmstart_steps == 0:
        return resolve_model(cfg.model)
    out = Path(args.output_dir) / "warmstart"
    if (out / "COMPLETE").exists():
        log.info("warm start: reusing %s", out)
        return json.loads((out / "COMPLETE").read_text())["merged_dir"]
    from accelerate import PartialState

    from generator.sft import run_sft

    state = PartialState()
    # every rank runs the SFT trainer (data-parallel under accelerate); the main process writes the merged model
    sft_args, config = warm_start_config(cfg, args, out, cfg.warmstart_steps, args.seed)
    metrics = run_sft(sft_args, config, train_records=data.warmstart, eval_records=[])
    if state.is_main_process:
        (out / "COMPLETE").write_text(json.dumps({"merged_dir": metrics["merged_dir"]}))
        print(f"warm start: {metrics['train_steps']} SFT steps, loss {metrics['train_loss']:.3f} "
              f"({metrics['train_runtime_s']:.0f}s)", flush=True)
    state.wait_for_everyone()
    return json.loads((out / "COMPLETE").read_text())["merged_dir"]


# -------------------------------------------------------------------------------------------- 2. discriminator fit


def make_discriminator(cfg: AdversaryConfig, seed: int):
    """The co-trained discriminator (`adversary.discriminator.Discriminator`): the neural member (on `discriminator`'s
    backbone, or with `disc_family: lmjudge` the language-model judge) and the classical n-gram member, weighted by
    `disc_weights`."""
    from adversary.discriminator import Discriminator
    from discriminator.neural import NeuralDetector

    neural = None
    if cfg.disc_weights[0] > 0 and cfg.disc_family == "lmjudge":
        from discriminator.lm_judge import LMJudge

        # its own LoRA adapter and head over a separate copy of the base weights (docs/scaling.md: what sharing the
        # generator's frozen base would save)
        neural = LMJudge(backbone=cfg.judge_backbone or cfg.model, max_length=cfg.disc_max_length,
                         context_tokens=cfg.disc_context_tokens, lr=cfg.disc_lr, batch_size=cfg.disc_batch_size,
                         label_smoothing=cfg.label_smoothing, seed=seed, precision=cfg.dtype)
    elif cfg.disc_weights[0] > 0:
        neural = NeuralDetector(backbone=cfg.discriminator, max_length=cfg.disc_max_length,
                                context_tokens=cfg.disc_context_tokens, lr=cfg.disc_lr, batch_size=cfg.disc_batch_size,
                                label_smoothing=cfg.label_smoothing, seed=seed, precision=cfg.dtype)
    return Discriminator(neural, classical=cfg.disc_weights[1] > 0, weights=tuple(cfg.disc_weights),
                         pool_size=cfg.disc_pool_size, seed=seed)


def fit_discriminator(cfg: AdversaryConfig, disc, model, tokenizer, data: RunData, seed: int) -> dict:
    """Initial fit on real turns against the (warm-started) generator's turns for the same train contexts. Every
    process fits the same way from the same seed and data, so the discriminator starts identical on every rank."""
    from adversary.heldout import heldout_settings
    from generator.engine import policy_engine
    from generator.sample import simulate_records

    t0 = time.perf_counter()
    judge_loaded = bool(cfg.judge_init and cfg.disc_family == "lmjudge" and disc.neural is not None)
    if judge_loaded:
        disc.neural.load(cfg.judge_init)  # warmed up elsewhere on this warm start's turns: no fit here
        from accelerate import PartialState

        PartialState().print(f"discriminator: the judge of {cfg.judge_init} (step {disc.neural.step})", flush=True)
        if not disc.use_classical:  # nothing else to fit: the n-gram member is what the turns below would feed
            return {"disc/init_items": 0, "disc/init_train_acc": float("nan"),
                    "disc/init_seconds": time.perf_counter() - t0}
    contexts = data.disc_fit
    with policy_engine(model, tokenizer, precision=cfg.dtype, batch_size=cfg.sim_batch_size) as engine:
        sims = simulate_records(engine, contexts, heldout_settings(cfg), seed=seed_for("fit_samples", seed))
    from adversary.discriminator import with_end

    on = cfg.disc_sees_end
    sims = [TurnRecord(id=s.id + "@sim", context=s.context,
                       user_turn=with_end(s.user_turn.strip() or "...", s.meta.get("ended", False), on)) for s in sims]
    reals = [TurnRecord(id=r.id, context=r.context, user_turn=with_end(r.user_turn, r.is_last, on)) if on else r
             for r in contexts]
    items = reals + sims
    labels = np.asarray([1] * len(contexts) + [0] * len(sims))
    if judge_loaded:
        disc.observe(items, labels)  # the judge came warmed up: only the n-gram member learns these turns
    else:
        disc.fit(items, labels, epochs=cfg.disc_epochs)
    from sklearn.metrics import accuracy_score

    acc = float(accuracy_score(labels, (disc.score(items) > 0).astype(int)))
    fit = {"disc/init_items": len(items), "disc/init_train_acc": acc, "disc/init_seconds": time.perf_counter() - t0}
    from accelerate import PartialState

    PartialState().print(f"discriminator: initial fit on {len(items)} turns, train acc {acc:.3f} "
                         f"({fit['disc/init_seconds']:.0f}s)", flush=True)
    return fit


# ------------------------------------------------------------------------------------------ 3-5. adversarial phase


def adversarial_phase(cfg: AdversaryConfig, args, model, tokenizer, state, data, meter, resume):
    """The phase the gate watches: the config's `objective` (adversary/objectives/: grpo, dpo_rounds, spin,
    resample_sft, or one registered at run time) run by the phase loop, which owns the meter, the gate and the best
    checkpoint. Returns its `PhaseResult`."""
    from adversary.objectives import get_objective
    from adversary.objectives.base import Phase

    phase = Phase(cfg, args, model, tokenizer, state, data, meter=meter, resume=resume)
    return get_objective(cfg.objective)(phase).run()


def check_ranks_identical(disc, ps) -> None:
    """Under several processes, every rank's discriminator fingerprint (neural weights, classical coefficients) is
    gathered, and the main process says whether they agree (the co-training broadcasts the neural member after each
    update and refits the classical one the same way on every rank)."""
    if ps.num_processes == 1:
        return
    from accelerate.utils import gather_object

    digests = set(gather_object([disc.fingerprint()]))
    ps.print(f"discriminator identical on {ps.num_processes} ranks: {'yes' if len(digests) == 1 else 'NO'}")


def check_faults(cfg: ObjectiveArgs, state) -> None:
    if state.faults.exceeded():
        from conversations.schema import DataError

        raise DataError(f"stopped: {state.faults.total} numerical faults (non-finite rewards, losses or gradients: "
                        f"{state.faults.counts}) exceed max_faults={cfg.max_faults}; lower the learning rate or reward_clip")


# ------------------------------------------------------------------------------------------------------- 6. export


def write_config(cfg: AdversaryConfig, args, out: Path) -> dict:
    """The resolved config, saved at the start of the run (and again in every checkpoint's state and the export)."""
    from accelerate import PartialState

    from adversary.config import resolved as resolved_config
    from conversations.config import to_jsonable

    resolved = {"adversary": resolved_config(cfg), "grpo": to_jsonable(args)}
    if PartialState().is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(resolved, indent=2, sort_keys=True))
    return resolved


def manifest(cfg: AdversaryConfig, args, data: RunData, state, start_model: str, base: dict | None) -> dict:
    """What the export records: provenance, the td curve and the best reading, the gate, and the sampling settings
    the simulator was measured with (its users default to them)."""
    import torch

    from adversary.config import resolved as resolved_config
    from adversary.heldout import heldout_settings
    from conversations.config import to_jsonable
    from generator.prompts import PROMPT_FORMAT_VERSION

    best, gate = state.gate.best, state.gate
    best_row = next((r for r in state.rows if r["step"] == best.step), {})
    return {
        "base_model": cfg.model, "warm_start": start_model, "data": cfg.data, "data_fingerprint": data.fingerprint,
        "config": {"adversary": resolved_config(cfg), "grpo": to_jsonable(args)}, "td_curve": state.rows,
        "best": {"step": best.step, "td": best.td, "td_ci95": [best.ci_low, best.ci_high], "gate_level": cfg.gate_level,
                 "turn_td": best_row.get("td/panel"),  # both levels of the best reading, whichever the gate read
                 "conversation": {k: v for k, v in best_row.items() if k.startswith("conv/")} or None},
        "gate": {"reason": gate.reason, "description": gate.describe()}, "base_model_td": base,
        "prompt_format_version": PROMPT_FORMAT_VERSION,
        # the calibrated end decision's offset of the best reading (none: the marker as sampled)
        "sampling": heldout_settings(cfg).replace(end_bias=best_row.get("conv/end_bias")).to_dict(),
        "precision": cfg.dtype, "objective": cfg.objective, "torch": torch.__version__,
    }


class StageTimer:
    """Wall seconds per named stage of the run (`with timer("warm_start"): ...`) and the process's peak resident
    memory when each stage ended (a rise shows which stage set the peak), for the summary."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.peak_rss_mb: dict[str, int] = {}

    def __call__(self, name: str):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            t0 = time.time()
            try:
                yield
            finally:
                release_memory()
                self.seconds[name] = round(self.seconds.get(name, 0.0) + time.time() - t0, 1)
                self.peak_rss_mb[name] = peak_rss_mb()

        return ctx()


def _ci_text(x: dict | None) -> str:
    """'td (low-high)' of a level, its conversation td after a slash where read."""
    if not x:
        return "-"
    conv = f" / conv {x['conv_td']:.1f} ({x['conv_td_ci95'][0]:.1f}-{x['conv_td_ci95'][1]:.1f})" if "conv_td" in x else ""
    return f"{x['td']:.1f} ({x['td_ci95'][0]:.1f}-{x['td_ci95'][1]:.1f}){conv}"


def write_summary(out: Path, state, base: dict | None, frozen: Path, t_start: float, timer: StageTimer | None = None,
                  threads: dict | None = None, levels: dict | None = None) -> None:
    from accelerate import PartialState

    if not PartialState().is_main_process:
        return
    best, gate = state.gate.best, state.gate
    wall = time.time() - t_start
    summary = {
        "start_td": round(state.rows[0]["td/panel"], 2), "best_td": round(best.td, 2),
        "best_td_ci95": [round(best.ci_low, 2), round(best.ci_high, 2)], "best_step": best.step,
        "gate": gate.reason, "export": str(frozen), "wall_seconds": round(wall, 1),
        "meter_share": round(state.meter_seconds / wall, 3),
        "stage_seconds": {**(timer.seconds if timer else {}), "meter (inside the phase)": round(state.meter_seconds, 1)},
        "stage_peak_rss_mb": timer.peak_rss_mb if timer else {},
        "peak_rss_mb": peak_rss_mb(),
        "threads": threads,  # conversations.threads: how many and why (a bare accelerate launch would give 1)
    }
    if base:
        summary["base_model_td"] = round(base["td/panel"], 2)
    if levels:  # base model, warm start, best checkpoint and the shipped export, each with its CI, both levels
        summary["simulators"] = levels
        summary["shipped_td"] = levels["shipped"]["td"]
        summary["shipped_td_ci95"] = levels["shipped"]["td_ci95"]
        if "conv_td" in levels["shipped"]:
            summary["shipped_conv_td"] = levels["shipped"]["conv_td"]
            summary["shipped_conv_td_ci95"] = levels["shipped"]["conv_td_ci95"]
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if levels:
        k = levels["shipped"].get("guidance", 1)
        print(f"done: td (95% CI) base {_ci_text(levels['base_model'])}, warm start {_ci_text(levels['warm_start'])}, "
              f"best {_ci_text(levels['best'])} at step {best.step}, shipped "
              f"{'with its guide K=' + str(k) if k > 1 else 'unguided'} {_ci_text(levels['shipped'])}; gate: "
              f"{gate.reason}; exported {frozen} (its report: README.md); {wall / 60:.1f} min", flush=True)
        return
    print(f"done: {'base td ' + str(summary['base_model_td']) + ', ' if base else ''}td {summary['start_td']} -> "
          f"best {summary['best_td']} (95% CI {summary['best_td_ci95'][0]}-{summary['best_td_ci95'][1]}) at step "
          f"{best.step}; gate: {gate.reason}; exported {frozen}; {wall / 60:.1f} min", flush=True)



def export_best(cfg: AdversaryConfig, args, best_dir: Path, manifest: dict, data: RunData | None = None) -> Path:
    """Merge the best checkpoint's adapter into its base and write the frozen export (atomic, hashed, read-only);
    with `export_guidance` K > 1, its guide is fitted on the merged simulator's own turns first and goes into the
    export (hashed with the rest) and into its manifest."""
    from accelerate import PartialState

    from adversary.export import export_frozen
    from generator.model import load_generator

    out = Path(cfg.export_dir or Path(args.output_dir) / "frozen")
    if PartialState().is_main_process:
        model, tok = load_generator(str(best_dir), trust_remote_code=args.trust_remote_code)  # adapter merged
        model.generation_config.do_sample = True
        extra = None
        if cfg.export_guidance > 1:
            from adversary.guidance import GUIDE_DIR

            guide = export_guide(cfg, args, model, tok, data, manifest)
            extra = lambda folder: guide.save(Path(folder) / GUIDE_DIR)  # noqa: E731
        export_frozen(model, tok, out, manifest, extra=extra)
    PartialState().wait_for_everyone()
    return out


def export_guide(cfg: AdversaryConfig, args, model, tok, data: RunData, manifest: dict):
    """The export's guide (`adversary.guidance.fit_guide`): the classical discriminator fitted on the real turns of
    `export_guide_contexts` train contexts against the export's own turns there, at the export's sampling settings,
    and calibrated on a held-back quarter of their conversations. Adds manifest["guidance"]."""
    import copy

    from adversary.guidance import GUIDE_DIR, fit_guide
    from generator.engine import Engine, SamplingSettings
    from generator.sample import simulate_records

    if data is None:
        raise ValueError("export_guidance > 1 needs the run's data (the guide's train contexts)")
    t0 = time.time()
    contexts = data.disc_fit + data.rest[: max(0, cfg.export_guide_contexts - len(data.disc_fit))]
    # the export's settings without the end decision: it is drawn apart from the text, after it (the same text
    # either way: tests/test_ending.py) and the guide reads the text alone: p_end for every turn was wasted here
    settings = SamplingSettings.from_dict({**manifest["sampling"], "end_bias": None})
    engine = Engine(model, tok, batch_size=cfg.sim_batch_size, precision=cfg.dtype)
    sims = simulate_records(engine, contexts, settings, seed=seed_for("fit_samples", args.seed))
    guide_cfg = copy.copy(cfg)
    guide_cfg.disc_weights = [0.0, 1.0]  # the classical member: its signal reached fresh detectors (docs/results.md)
    guide = fit_guide(make_discriminator(guide_cfg, args.seed), contexts, sims, 0.25, cfg.export_guidance,
                      cfg.export_guide_rule, epochs=cfg.disc_epochs)
    cal = guide.report["heldback"]
    manifest["guidance"] = {"k": guide.k, "rule": guide.rule, "dir": GUIDE_DIR, "members": guide.report["members"],
                            "calibration": cal, "fit_items": guide.report["fit_items"],
                            "seconds": round(time.time() - t0, 1), "source": "the main job's export stage"}
    print(f"export guide: K={guide.k} ({guide.rule}), {guide.report['fit_items']} turns fitted, held-back pairs acc "
          f"{cal['raw']['accuracy']:.3f}, ECE {cal['raw']['ece']:.3f} -> {cal['calibrated']['ece']:.3f}, "
          f"{time.time() - t0:.0f}s", flush=True)
    return guide
