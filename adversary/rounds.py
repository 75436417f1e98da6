"""The DPO pieces of the preference objectives (`adversary.objectives.dpo_rounds`, `.spin`), after DIAL: instead of
a policy gradient on one reward per completion, the discriminator's ranking of several samples per context becomes
preference pairs trained with TRL's `DPOTrainer`.

- `round_contexts`: round k's training contexts (the run's adversarial contexts in a seeded order, never held-out);
- `build_pairs`: per context (chosen, rejected) = (the most real-looking sample that ended within the token budget,
  or the real turn with `round_chosen: real`; the least real-looking sample); pairs closer than `round_min_margin`
  dropped;
- `train_round`: DPO on the pairs (LoRA; reference: the policy at the round's start, `dpo_beta`, `dpo_loss`;
  `dpo_sft_weight` adds an NLL term on the chosen turn, RPO).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from conversations.assets import before_another_trainer
from conversations.schema import TurnRecord
from conversations.seeds import seed_for

if TYPE_CHECKING:
    from adversary.config import AdversaryConfig, DataArgs, ObjectiveArgs

# pairs padded to a multiple of this many tokens: a few allocation sizes that glibc reuses, not one per length (a
# round's resident memory grew with every micro-batch of a new length; 3.5 -> 3.2 GB by this alone, same time)
DPO_PAD_MULTIPLE = 32


def round_contexts(data, cfg: ObjectiveArgs, k: int, seed: int) -> list[TurnRecord]:
    """Round k's contexts: consecutive slices of the adversarial contexts in one seeded order (reshuffled each pass)."""
    pool = data.grpo
    n = min(cfg.round_contexts, len(pool))
    per_pass = len(pool) // n
    order = random.Random(seed_for("round_pass", seed, k // per_pass)).sample(range(len(pool)), len(pool))
    at = (k % per_pass) * n
    return [pool[i] for i in order[at:at + n]]


def build_pairs(cfg: ObjectiveArgs, contexts: list[TurnRecord], samples: list[list],
                scores: np.ndarray) -> tuple[list[dict], dict]:
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


def dpo_dataset(rows: list[dict], tokenizer, cfg: DataArgs):
    from datasets import Dataset

    from generator.prompts import fit_messages

    return Dataset.from_list([
        {"prompt": fit_messages(tokenizer, r["prompt_context"], max_context_tokens=cfg.max_context_tokens),
         "chosen": [{"role": "assistant", "content": r["chosen"]}],
         "rejected": [{"role": "assistant", "content": r["rejected"]}]}
        for r in rows
    ])


def dpo_config(cfg: AdversaryConfig, args, out: Path, epochs: int = 1):
    from trl import DPOConfig

    from conversations.precision import trainer_precision_kwargs

    loss, weights = ([cfg.dpo_loss, "sft"], [1.0, cfg.dpo_sft_weight]) if cfg.dpo_sft_weight else ([cfg.dpo_loss], None)
    return DPOConfig(
        output_dir=str(out), num_train_epochs=epochs, per_device_train_batch_size=cfg.dpo_micro_batch,
        gradient_accumulation_steps=cfg.dpo_batch_size // cfg.dpo_micro_batch, learning_rate=cfg.dpo_lr,
        lr_scheduler_type="constant", warmup_steps=0, beta=cfg.dpo_beta, loss_type=loss, loss_weights=weights,
        max_length=cfg.warmstart_max_length + cfg.heldout_max_new_tokens, precompute_ref_log_probs=True,
        precompute_ref_batch_size=4 * cfg.dpo_micro_batch,  # no gradients: larger batches
        activation_checkpointing=cfg.dpo_checkpointing, activation_checkpointing_kwargs={"use_reentrant": False},
        pad_to_multiple_of=DPO_PAD_MULTIPLE, save_strategy="no", report_to="none", logging_steps=1, disable_tqdm=True,
        seed=args.seed, data_seed=args.seed, dataloader_num_workers=0, **trainer_precision_kwargs(cfg.dtype),
    )


def train_round(cfg: AdversaryConfig, args, model, tokenizer, rows: list[dict], out: Path, budget_left: float | None,
                epochs: int = 1):
    """`epochs` of DPO on the round's pairs; returns (the model, the trainer's log history, optimiser steps)."""
    from trl import DPOTrainer

    from adversary.trainer_parts import TimeBudget
    from generator.model import pick_device, prepare_training

    prepare_training(model, pick_device(), cfg.warmstart_max_length + cfg.heldout_max_new_tokens)
    before_another_trainer()
    trainer = DPOTrainer(model=model, args=dpo_config(cfg, args, out, epochs), train_dataset=dpo_dataset(rows, tokenizer, cfg),
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
