"""Held-out Turing distance: a fixed set of test-split contexts (never used to train the generator or the
discriminator), one simulated turn each with a fixed sampling seed (the same at every evaluation, so that readings
differ by the generator, not by sampling luck), scored by a freshly trained detector panel (`discriminator.turing`).

Under several processes each rank simulates its shard of the contexts; the main process measures.
"""

from __future__ import annotations

import copy
import math
import time
from contextlib import contextmanager

from adversary.crashpoints import crash_point
from conversations.schema import TurnRecord
from discriminator.turing import measure_td
from generator.diagnostics import realism_diagnostics
from generator.prompts import strip_end_marker
from generator.sample import simulate_records


def simulate_heldout(model, tokenizer, records: list[TurnRecord], cfg, accelerator=None, seed: int = 1234,
                     **generate_kw) -> list[TurnRecord]:
    """Simulate one turn per held-out context (sharded over ranks when `accelerator` has several processes).
    `generate_kw` go to `generator.sample.generate_texts` (e.g. `share_prefix`, `fast_sampling`)."""
    n_proc = accelerator.num_processes if accelerator is not None else 1
    rank = accelerator.process_index if accelerator is not None else 0
    per = math.ceil(len(records) / n_proc)
    shard = records[rank * per : (rank + 1) * per]
    # equal shard sizes: under ZeRO-3 every rank must run the same number of forward passes
    shard = shard + records[: per - len(shard)] if len(shard) < per else shard
    was_training = model.training
    model.eval()
    crash_point("generation")
    try:
        sims = simulate_records(
            model, tokenizer, shard,
            max_new_tokens=cfg.heldout_max_new_tokens,
            max_context_tokens=cfg.max_context_tokens,
            batch_size=cfg.sim_batch_size,
            seed=seed + rank,
            **generate_kw,
        )
    finally:
        model.train(was_training)
    if n_proc > 1:
        from accelerate.utils import gather_object

        sims = gather_object(sims)
    seen, out = set(), []
    for s in sims:
        if s.id not in seen:
            seen.add(s.id)
            out.append(s)
    return out


@contextmanager
def generation_model(model_wrapped, accelerator, *, merge_lora: bool = True, gather_zero3: bool = True):
    """The trainer's model, ready for `generate` outside TRL: unwrapped, gradient checkpointing off (TRL's
    `unwrap_model_for_generation`, which under ZeRO-3 also gathers the partitioned weights so that every rank runs
    whole layers; otherwise ranks whose sequences end early would stop joining the all-gathers the others wait on)
    and, with `merge_lora` on an unsharded LoRA model, a merged copy (plain linear layers: LoRA's extra matmuls
    cost ~20% of a decoding step on a CPU). The copy is dropped on exit; the training weights are never touched."""
    from accelerate.utils import DistributedType
    from trl.models import unwrap_model_for_generation

    sharded = accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP)
    with unwrap_model_for_generation(model_wrapped, accelerator, gather_deepspeed3_params=gather_zero3) as model:
        if merge_lora and not sharded and hasattr(model, "merge_and_unload"):
            yield copy.deepcopy(model).merge_and_unload().eval()  # + one copy of the weights for the evaluation
        else:
            yield model


def measure_heldout(real: list[TurnRecord], sims: list[TurnRecord], cfg, seed: int = 0) -> dict:
    """One row of the td curve: panel td with CI, each detector's td, AUC, paired accuracy, diagnostics."""
    t0 = time.perf_counter()
    clean = []
    for s in sims:
        text, ended = strip_end_marker(s.user_turn)
        clean.append(TurnRecord(id=s.id, context=s.context, user_turn=text.strip() or "...", conversation_id=s.conversation_id,
                                meta={**s.meta, "ended": ended}))
    report = measure_td(real, clean, detectors=tuple(cfg.heldout_detectors), folds=cfg.heldout_folds, seed=seed)
    lo, hi = report["turing_distance_ci95"]
    row = {
        "td": report["turing_distance"],
        "td_ci_low": lo,
        "td_ci_high": hi,
        "signed": report["signed"],
        "auc": report["auc"],
        "paired_accuracy": report.get("paired_accuracy"),
        "headline_detector": report.get("headline_detector"),
        "td/panel": report["turing_distance"],
    }
    for name, d in report["detectors"].items():
        row[f"td/{name}"] = d["turing_distance"]
    for k, v in realism_diagnostics(sims, real).items():
        row[f"diag/{k}"] = v
    row["meter_seconds"] = time.perf_counter() - t0
    return row
