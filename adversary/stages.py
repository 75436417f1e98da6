"""The stages of the main job, each a small function that `adversary/train.py` calls in order."""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from conversations.fingerprint import fingerprint
from conversations.schema import TurnRecord
from generator.data import load_turns, sample_records

log = logging.getLogger("adversary")


@dataclass
class RunData:
    train: list[TurnRecord]  # train split: SFT, discriminator fit, GRPO prompts
    heldout: list[TurnRecord]  # test split: the fixed held-out contexts of the meter, never trained on
    fingerprint: str


def prepare_data(cfg, seed: int) -> RunData:
    """Real user turns, split by conversation (no conversation in two splits), with the held-out set fixed by seed."""
    kw = dict(max_context_messages=cfg.max_context_messages, max_turn_chars=cfg.max_turn_chars)
    train = [r for r in load_turns(cfg.data, "train", **kw) if r.user_turn.strip()]
    test = [r for r in load_turns(cfg.data, "test", **kw) if r.user_turn.strip()]
    heldout = sample_records(test, cfg.heldout_contexts, seed=seed)
    if len(heldout) < 20:
        from conversations.schema import DataError

        raise DataError(f"only {len(heldout)} held-out turns in the test split; the meter needs at least 20", cfg.data)
    return RunData(train=train, heldout=heldout, fingerprint=fingerprint(train + heldout))


def base_model_td(cfg, args, data: RunData) -> dict | None:
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
    return {k: v for k, v in row.items() if k.startswith(("td/", "diag/len_ratio", "diag/assistant", "diag/end"))}


# ------------------------------------------------------------------------------------------------------ 1. warm start


def warm_start(cfg, args, data: RunData) -> str:
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

    from generator.sft import SFTArgs, run_sft

    state = PartialState()
    # every rank runs the SFT trainer (data-parallel under accelerate); the main process writes the merged model
    sft_args = SFTArgs(
        model=cfg.model,
        output_dir=str(out),
        max_steps=cfg.warmstart_steps,
        per_device_train_batch_size=cfg.warmstart_micro_batch,
        gradient_accumulation_steps=cfg.warmstart_batch_size // cfg.warmstart_micro_batch,
        learning_rate=cfg.warmstart_lr,
        lora_r=cfg.lora_r or 16,
        lora_alpha=cfg.lora_alpha,
        max_context_messages=cfg.max_context_messages,
        max_context_tokens=cfg.max_context_tokens,
        max_turn_chars=cfg.max_turn_chars,
        max_length=cfg.warmstart_max_length,
        seed=args.seed,
        eval_turns=0,
        save_adapter=False,
        save_merged=True,
        trust_remote_code=args.trust_remote_code,
        dtype=cfg.dtype,
    )
    n = cfg.warmstart_steps * cfg.warmstart_batch_size
    metrics = run_sft(sft_args, train_records=sample_records(data.train, n, seed=args.seed), eval_records=[])
    if state.is_main_process:
        (out / "COMPLETE").write_text(json.dumps({"merged_dir": metrics["merged_dir"]}))
        print(f"warm start: {metrics['train_steps']} SFT steps, loss {metrics['train_loss']:.3f} "
              f"({metrics['train_runtime_s']:.0f}s)", flush=True)
    state.wait_for_everyone()
    return json.loads((out / "COMPLETE").read_text())["merged_dir"]


# -------------------------------------------------------------------------------------------- 2. discriminator fit


def make_discriminator(cfg, seed: int):
    from discriminator.neural import NeuralDiscriminator

    return NeuralDiscriminator(
        backbone=cfg.discriminator,
        max_length=cfg.disc_max_length,
        context_tokens=cfg.disc_context_tokens,
        lr=cfg.disc_lr,
        batch_size=cfg.disc_batch_size,
        label_smoothing=cfg.label_smoothing,
        seed=seed,
        precision=cfg.dtype,
    )


def fit_discriminator(cfg, disc, model, tokenizer, data: RunData, seed: int) -> dict:
    """Initial fit on real turns against the (warm-started) generator's turns for the same train contexts. Every
    process fits the same way from the same seed and data, so the discriminator starts identical on every rank."""
    from adversary.heldout import heldout_settings
    from generator.engine import Engine, inference_copy
    from generator.sample import simulate_records

    t0 = time.perf_counter()
    contexts = sample_records(data.train, cfg.disc_init_items, seed=seed + 1)
    engine = Engine(inference_copy(model, cfg.dtype), tokenizer, batch_size=cfg.sim_batch_size, precision=cfg.dtype)
    sims = simulate_records(engine, contexts, heldout_settings(cfg), seed=seed + 2)
    del engine
    sims = [TurnRecord(id=s.id + "@sim", context=s.context, user_turn=s.user_turn.strip() or "...") for s in sims]
    items = list(contexts) + sims
    labels = np.asarray([1] * len(contexts) + [0] * len(sims))
    disc.fit(items, labels, epochs=cfg.disc_epochs)
    scores = np.asarray(disc.score(items))
    acc = float(np.mean((scores > 0).astype(int) == labels))
    return {"disc/init_items": len(items), "disc/init_train_acc": acc, "disc/init_seconds": time.perf_counter() - t0,
            "init_simulated": sims}


# ------------------------------------------------------------------------------------------------------- 6. export


def export_best(cfg, args, best_dir: Path, manifest: dict) -> Path:
    """Merge the best checkpoint's adapter into its base and write the frozen export (atomic, hashed, read-only)."""
    from accelerate import PartialState

    from adversary.export import export_frozen
    from generator.model import load_generator

    out = Path(cfg.export_dir or Path(args.output_dir) / "frozen")
    if PartialState().is_main_process:
        model, tok = load_generator(str(best_dir), trust_remote_code=args.trust_remote_code)  # adapter merged
        model.generation_config.do_sample = True
        export_frozen(model, tok, out, manifest)
    PartialState().wait_for_everyone()
    return out


def save_policy(trainer, out: Path) -> None:
    """Save the generator as it is now (adapter only under LoRA) into `out`, replacing what was there; collective
    under DeepSpeed/FSDP (every rank calls it)."""
    tmp = out.with_name(out.name + ".tmp")
    if trainer.accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()
    trainer.save_model(str(tmp))
    if trainer.accelerator.is_main_process:
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    trainer.accelerator.wait_for_everyone()
