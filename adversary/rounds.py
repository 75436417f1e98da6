"""The adversarial phase as rounds of preference optimisation against the discriminator (`objective: dpo_rounds`),
after DIAL: instead of a policy gradient on one reward per completion, each round turns the discriminator's
ranking of several samples per context into preference pairs and trains on them with TRL's `DPOTrainer`.

One round:
1. `round_contexts` training contexts (the run's adversarial contexts, in a seeded order; never held-out ones), and
   `round_samples` turns sampled for each by the current policy (the generation engine on a merged inference copy);
2. every turn scored by the discriminator (log-odds of real); per context the pair is (chosen, rejected) =
   (the most real-looking sample that ended within the token budget, the least real-looking sample), or with
   `round_chosen: real` (the real turn, the least real-looking sample); pairs closer than `round_min_margin` dropped;
3. one epoch of DPO on the pairs (LoRA; reference: the policy at the round's start, `dpo_beta`; `dpo_sft_weight` adds
   an NLL term on the chosen turn, RPO);
4. the discriminator co-trained on one sample per context against the real turns of the same contexts
   (`adversary.cotrain.cotrain_round`);
5. every `eval_rounds` rounds the held-out meter reads td, the gate decides, the best adapter is saved.
The run state (`AdversaryState`) and the adapter are checkpointed after every round; a resumed run continues with
the next round. The curve's "step" is the number of DPO optimiser steps so far. One process only (the GRPO objective
covers several).
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import time
from pathlib import Path

import numpy as np

from conversations.schema import DataError, TurnRecord

ROUND_DIR = "round-{:04d}"
# pairs padded to a multiple of this many tokens: a few allocation sizes that glibc reuses, not one per length (a
# round's resident memory grew with every micro-batch of a new length; 3.5 -> 3.2 GB by this alone, same time)
DPO_PAD_MULTIPLE = 32


def round_contexts(data, cfg, k: int, seed: int) -> list[TurnRecord]:
    """Round k's contexts: consecutive slices of the adversarial contexts in one seeded order (reshuffled each pass)."""
    pool = data.grpo
    n = min(cfg.round_contexts, len(pool))
    per_pass = len(pool) // n
    order = random.Random(seed * 1_000_003 + k // per_pass).sample(range(len(pool)), len(pool))
    at = (k % per_pass) * n
    return [pool[i] for i in order[at:at + n]]


def build_pairs(cfg, contexts: list[TurnRecord], samples: list[list], scores: np.ndarray) -> tuple[list[dict], dict]:
    """DPO rows {prompt, chosen, rejected} (conversational, what TRL's DPOTrainer takes) and the round's figures.
    `samples[i]` are context i's `SimulatedTurn`s, `scores` their log-odds (n_contexts, round_samples)."""
    from generator.prompts import END_MARKER, END_SEPARATOR, target_text

    def as_target(t) -> str:
        return t.text + END_SEPARATOR + END_MARKER if t.ended else t.text

    rows, margins, chosen_real = [], [], 0
    for ctx, turns, s in zip(contexts, samples, scores):
        worst = int(np.argmin(s))
        if cfg.round_chosen == "real":
            chosen_text, margin = target_text(ctx), float("inf")
            chosen_real += 1
        else:
            ok = [j for j, t in enumerate(turns) if not t.truncated and t.text]  # a cut turn is never a target
            if not ok:
                continue
            best = max(ok, key=lambda j: s[j])
            if best == worst:
                continue
            chosen_text, margin = as_target(turns[best]), float(s[best] - s[worst])
            margins.append(margin)
        if margin < cfg.round_min_margin:
            continue
        rows.append({"prompt_context": ctx.context, "chosen": chosen_text, "rejected": as_target(turns[worst]) or "..."})
    figures = {"round/pairs": len(rows), "round/margin_mean": float(np.mean(margins)) if margins else None,
               "round/score_mean": float(np.mean(scores)), "round/score_best_mean": float(np.mean(scores.max(1)))}
    return rows, figures


def dpo_dataset(rows: list[dict], tokenizer, cfg):
    from datasets import Dataset

    from generator.prompts import fit_messages

    return Dataset.from_list([
        {"prompt": fit_messages(tokenizer, r["prompt_context"], max_context_tokens=cfg.max_context_tokens),
         "chosen": [{"role": "assistant", "content": r["chosen"]}],
         "rejected": [{"role": "assistant", "content": r["rejected"]}]}
        for r in rows
    ])


def dpo_config(cfg, args, out: Path):
    from trl import DPOConfig

    from conversations.precision import trainer_precision_kwargs

    loss, weights = (["sigmoid", "sft"], [1.0, cfg.dpo_sft_weight]) if cfg.dpo_sft_weight else (["sigmoid"], None)
    return DPOConfig(
        output_dir=str(out), num_train_epochs=1, per_device_train_batch_size=cfg.dpo_micro_batch,
        gradient_accumulation_steps=cfg.dpo_batch_size // cfg.dpo_micro_batch, learning_rate=cfg.dpo_lr,
        lr_scheduler_type="constant", warmup_steps=0, beta=cfg.dpo_beta, loss_type=loss, loss_weights=weights,
        max_length=cfg.warmstart_max_length + cfg.heldout_max_new_tokens, precompute_ref_log_probs=True,
        precompute_ref_batch_size=4 * cfg.dpo_micro_batch,  # no gradients: larger batches
        activation_checkpointing=cfg.dpo_checkpointing, activation_checkpointing_kwargs={"use_reentrant": False},
        pad_to_multiple_of=DPO_PAD_MULTIPLE, save_strategy="no", report_to="none", logging_steps=1, disable_tqdm=True,
        seed=args.seed, data_seed=args.seed, dataloader_num_workers=0, **trainer_precision_kwargs(cfg.dtype),
    )


def train_round(cfg, args, model, tokenizer, rows: list[dict], out: Path, budget_left: float):
    """One epoch of DPO on the round's pairs; returns (the model, the trainer's log history, optimiser steps)."""
    from trl import DPOTrainer

    from adversary.trainer_parts import TimeBudget
    from generator.model import pick_device, prepare_training

    prepare_training(model, pick_device(), cfg.warmstart_max_length + cfg.heldout_max_new_tokens)
    trainer = DPOTrainer(model=model, args=dpo_config(cfg, args, out), train_dataset=dpo_dataset(rows, tokenizer, cfg),
                         processing_class=tokenizer, callbacks=[TimeBudget(budget_left)] if budget_left else None)
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.train()
    history, steps = list(trainer.state.log_history), int(trainer.state.global_step)
    model = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)
    if "ref" in getattr(model, "peft_config", {}):  # TRL's per-round reference adapter (a copy of the policy's)
        model.delete_adapter("ref")
        model.set_adapter("default")
    del trainer
    shutil.rmtree(out, ignore_errors=True)
    return model, history, steps


def save_round(model, state, out_dir: Path, k: int, step: int, keep: int = 2) -> Path:
    """OUTPUT_DIR/round-k: the adapter and the run state, the state's COMPLETE marker written last; only the newest
    `keep` complete rounds stay (each holds the discriminator and its optimiser)."""
    from adversary.state import COMPLETE, STATE_DIR

    d = out_dir / ROUND_DIR.format(k)
    model.save_pretrained(str(d))
    (d / "round.json").write_text(json.dumps({"round": k, "step": step}))
    state.save(d)
    done = sorted(p for p in out_dir.glob("round-*") if (p / STATE_DIR / COMPLETE).exists())
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return d


def latest_round(out_dir: Path) -> Path | None:
    from adversary.state import COMPLETE, STATE_DIR

    found = sorted(p for p in Path(out_dir).glob("round-*") if (p / STATE_DIR / COMPLETE).exists())
    return found[-1] if found else None


def run_rounds(cfg, args, model, tokenizer, state, data, meter=None, *, resume: Path | None = None,
               start_time: float | None = None) -> dict:
    """The rounds objective (see the module docstring). `model`: the warm-started generator (plain weights); a LoRA
    adapter is added here (or restored from `resume`, a round folder). Returns the phase's figures."""
    from peft import PeftModel, get_peft_model

    from accelerate import PartialState

    from adversary.cotrain import cotrain_round
    from conversations.memory import peak_rss_mb, release_memory
    from adversary.heldout import heldout_settings
    from generator.engine import Engine, inference_copy
    from generator.model import lora_config
    from generator.sample import user_turns

    if PartialState().num_processes > 1:
        raise DataError("objective dpo_rounds runs in one process; use objective grpo to train on several")
    if cfg.lora_r <= 0:
        raise DataError("objective dpo_rounds trains a LoRA adapter: set lora_r > 0")
    out = Path(args.output_dir)
    start_time = start_time or time.time()
    step = 0
    if resume is not None:
        model = PeftModel.from_pretrained(model, str(resume), is_trainable=True)
        state.load(resume)
        step = json.loads((resume / "round.json").read_text())["step"]
    else:
        model = get_peft_model(model, lora_config(cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout))
    settings = heldout_settings(cfg).replace(temperature=args.temperature)  # GRPO's sampling temperature
    figures = []

    @contextlib.contextmanager
    def frozen_copy():  # made when the meter starts simulating, dropped when it is done
        yield inference_copy(model, cfg.dtype)

    def evaluate():
        if meter is None:
            return False
        row, stop, is_best = meter.evaluate(step, frozen_copy(),
                                            extra={"disc/acc": state.cotrain_history[-1]["disc/acc"]
                                                   if state.cotrain_history else None})
        if is_best:
            best = out / "best"
            shutil.rmtree(best, ignore_errors=True)
            model.save_pretrained(str(best))
            (best / "best.json").write_text(json.dumps(row, default=str, indent=2))
        return stop

    stop = False
    if meter is not None and not state.rows:
        stop = evaluate()
    last_round, ended = 0.0, "max_steps"
    while not stop:
        k = state.rounds_done
        left = cfg.phase_seconds - (time.time() - start_time) if cfg.phase_seconds else 0.0
        # a time budget does not start a round it cannot get half through (sampling and scoring come first)
        ended = ("max_rounds" if cfg.max_rounds and k >= cfg.max_rounds else
                 "max_steps" if args.max_steps > 0 and step >= args.max_steps else
                 "phase_seconds" if cfg.phase_seconds and left <= max(0.0, 0.5 * last_round) else None)
        if ended:
            break
        t0 = time.time()
        contexts = round_contexts(data, cfg, k, args.seed)
        engine = Engine(inference_copy(model, cfg.dtype), tokenizer, batch_size=cfg.sim_batch_size, precision=cfg.dtype)
        many = [c for c in contexts for _ in range(cfg.round_samples)]
        turns = user_turns(engine, [c.context for c in many], settings, seed=args.seed * 7919 + k)
        del engine
        release_memory()
        samples = [turns[i * cfg.round_samples:(i + 1) * cfg.round_samples] for i in range(len(contexts))]
        sims = [TurnRecord(id=f"{c.id}@sim{j}", context=c.context, user_turn=t.text or "...")
                for c, ts in zip(contexts, samples) for j, t in enumerate(ts)]
        scores = np.asarray(state.discriminator.score(sims)).reshape(len(contexts), cfg.round_samples)
        rows, fig = build_pairs(cfg, contexts, samples, scores)
        t_gen = time.time() - t0
        dpo_steps, history = 0, []
        if rows:
            model, history, dpo_steps = train_round(cfg, args, model, tokenizer, rows, out / "dpo-round", left)
            step += dpo_steps
            release_memory()  # the trainer's freed activations, before the co-training and the meter land on them
        # co-training on one sample per context (the first: an unbiased draw) against the context's real turn
        fresh = [(c.context, ts[0].text or "...", c.user_turn, c.id) for c, ts in zip(contexts, samples)]
        cot = cotrain_round(cfg, state, fresh, step)
        state.rounds_done = k + 1
        losses = [h["loss"] for h in history if "loss" in h]
        fig.update({"round": k, "step": step, "round/seconds": time.time() - t0, "round/sample_seconds": t_gen,
                    "round/dpo_steps": dpo_steps, "round/dpo_loss": float(np.mean(losses)) if losses else None,
                    "round/truncated_rate": float(np.mean([t.truncated for t in turns])),
                    "round/end_rate": float(np.mean([t.ended for t in turns])),
                    "round/peak_rss_mb": peak_rss_mb(),
                    **{k2: v for k2, v in cot.items() if k2 != "step"}})
        figures.append(fig)
        last_round = fig["round/seconds"]
        loss = f"{fig['round/dpo_loss']:.3f}" if fig["round/dpo_loss"] is not None else "-"
        print(f"[round {k}] {fig['round/pairs']} pairs, {dpo_steps} DPO steps (loss {loss}), discriminator acc on "
              f"fresh {cot['disc/acc']:.3f}, {fig['round/seconds']:.0f}s, peak memory {fig['round/peak_rss_mb']} MB",
              flush=True)
        if (k + 1) % cfg.eval_rounds == 0 and (not state.rows or step > state.rows[-1]["step"]):
            stop = evaluate()
        save_round(model, state, out, k, step)
        release_memory()
    if meter is not None and state.rows and state.rows[-1]["step"] < step and not state.gate.stopped:
        evaluate()
    state.gate.finish(step, ended or "max_steps")
    if meter is not None:
        meter.write_outputs()
    (out / "rounds.json").write_text(json.dumps(figures, indent=2, default=float))
    return {"model": model, "steps": step, "rounds": state.rounds_done, "figures": figures}
