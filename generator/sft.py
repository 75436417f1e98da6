"""SFT warm start: fine-tune the simulator on real user turns with TRL's SFTTrainer, loss on the user side only.

Configuration: `SFTArgs` (ours: model, data, LoRA, the prompt budget, held-out perplexity, what is saved) beside TRL's
`SFTConfig` (optimiser, schedule, batch, `max_length`, seed, output folder), parsed together as the main job parses
its config beside `GRPOConfig`.

Each real turn becomes a prompt-completion example: the prompt is the role-flipped conversation (`fit_messages`,
exactly what the simulator sees at sampling time), the completion the real user turn as the simulator's (assistant)
message, with END_MARKER on the last turn of a conversation. TRL applies the chat template and, with
`completion_only_loss`, masks the prompt. LoRA by default.

    python -m generator.sft --config configs/sft.yaml [--max_steps 60 ...]

prints a JSON summary: held-out perplexity of real user turns before and after, and where the model was saved.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from conversations import TurnRecord
from conversations.assets import before_another_trainer
from conversations.cli_util import friendly_errors
from conversations.config import ConfigError, parse_config, to_jsonable
from conversations.schema import DataError
from conversations.seeds import seed_for
from generator.model import LoraArgs
from generator.prompts import END_MARKER, PROMPT_FORMAT_VERSION
from generator.token_losses import TOKEN_LOSSES, token_loss
from generator.sft_examples import (_MIN_PROMPT_TOKENS, build_sft_dataset, encode_example,  # noqa: F401 re-exported
                                    sft_example, sft_examples)

log = logging.getLogger(__name__)


@dataclass
class SFTArgs(LoraArgs):
    """What the warm start needs besides TRL's `SFTConfig` (which holds the optimiser, schedule, batch, `max_length`,
    seed, output folder and logging): the model, the data and how a turn becomes an example, LoRA, the held-out
    perplexity, and what is saved. The CLI parses both side by side (`parse_config((SFTArgs, SFTConfig), argv)`)."""

    model: str = "smollm2-135m-instruct"
    data: str = "sharegpt"
    use_lora: bool = True  # the LoRA fields: generator.model.LoraArgs
    lora_target_modules: str = "all-linear"
    # context: at most this many messages before the turn (None: all), and at most this many prompt tokens
    max_context_messages: Optional[int] = 2
    max_context_tokens: int = 256
    # turns longer than this are left out (not cut: a cut turn would teach the simulator to stop mid-sentence)
    max_turn_chars: Optional[int] = 500
    skip_first: bool = False
    # training turns drawn from the train split (None: max_steps x batch x accumulation, one pass)
    train_turns: Optional[int] = None
    # held-out real turns (val split) for the perplexity before and after
    eval_turns: int = 128
    eval_batch_size: int = 8
    val_frac: float = 0.05
    test_frac: float = 0.05
    # warm-up as a share of the steps (transformers 5 takes it as a fractional warmup_steps)
    warmup_ratio: float = 0.05
    dtype: str = "auto"  # precision: auto, bf16 or fp32 (conversations.precision)
    device: Optional[str] = None
    save_adapter: bool = True
    # also save the adapter merged into the base: a plain model folder the next stage loads as is
    save_merged: bool = True
    # the token loss: nll; tailr (each token's NLL weighted by p / (gamma + (1 - gamma) p), p the model's
    # probability of the token, detached: TaiLr, Ji et al. 2023; down-weights the tokens the model finds unlikely); or
    # mixce (weighted by eta + (1 - eta) p: MixCE, Zhang et al. 2023, the forward cross-entropy mixed with its
    # self-reinforced approximation of the reverse one; eta 1 is the NLL)
    loss: str = "nll"
    tailr_gamma: float = 0.5
    mixce_eta: float = 0.5

    def __post_init__(self):
        from conversations.assets import check_model_name
        from conversations.config import check_ranges
        from conversations.precision import normalise_dtype

        check_ranges(self, SFT_RANGES)
        if self.loss not in TOKEN_LOSSES:
            raise ConfigError(f"loss must be one of {', '.join(TOKEN_LOSSES)}, not {self.loss!r}")
        self.dtype = normalise_dtype(self.dtype)
        check_model_name(self.model, "model")


SFT_RANGES = {
    "warmup_ratio": "[0, 1)", "lora_r": ">= 1", "lora_alpha": "> 0", "lora_dropout": "[0, 1)",
    "max_context_messages": ">= 0", "max_turn_chars": ">= 1", "max_context_tokens": f">= {_MIN_PROMPT_TOKENS}",
    "train_turns": ">= 1", "eval_turns": ">= 0", "eval_batch_size": ">= 1", "val_frac": "[0, 0.5)",
    "test_frac": "[0, 0.5)", "tailr_gamma": "[0, 1]", "mixce_eta": "[0, 1]",
}
# our defaults for TRL's SFTConfig (its own defaults are a GPU's: bf16, 1024 tokens, gradient checkpointing on)
SFT_CONFIG_DEFAULTS = {
    "output_dir": "outputs/sft", "max_steps": 40, "per_device_train_batch_size": 8, "learning_rate": 2e-4,
    "lr_scheduler_type": "cosine", "max_length": 512, "logging_steps": 5, "save_strategy": "no", "report_to": "none",
    "completion_only_loss": True, "packing": False, "gradient_checkpointing": False, "dataloader_num_workers": 0,
    "disable_tqdm": True,
}


def sft_config(**fields):
    """TRL's SFTConfig with our defaults (`SFT_CONFIG_DEFAULTS`) and `fields` over them."""
    import torch
    from trl import SFTConfig

    # without a GPU, fp32 until `prepare_config` applies the run's precision (transformers refuses bf16 without use_cpu)
    on_cpu = {} if torch.cuda.is_available() else {"use_cpu": True, "bf16": False}
    return SFTConfig(**{**SFT_CONFIG_DEFAULTS, **on_cpu, **fields})


def prepare_config(args: SFTArgs, config, device: str) -> None:
    """Fit a parsed SFTConfig to `args`: the run's precision, the warm-up ratio, checkpointing kwargs, and the check
    that a turn fits beside the prompt."""
    from conversations.precision import apply_precision, resolve_precision

    if config.max_length is None or config.max_length <= args.max_context_tokens:
        raise ConfigError(f"max_length ({config.max_length}) must be larger than max_context_tokens "
                          f"({args.max_context_tokens}) to leave room for the user turn; raise --max_length or lower "
                          "--max_context_tokens")
    apply_precision(config, resolve_precision(args.dtype, device))
    if not config.warmup_steps and args.warmup_ratio:
        config.warmup_steps = args.warmup_ratio  # a float < 1: a share of the steps
    if config.gradient_checkpointing and config.gradient_checkpointing_kwargs is None:
        config.gradient_checkpointing_kwargs = {"use_reentrant": False}
    config.data_seed = config.seed


def heldout_perplexity(
    model,
    tokenizer,
    records: Sequence[TurnRecord],
    batch_size: int = 8,
    *,
    max_context_tokens: int = 256,
    max_length: int | None = 512,
) -> float:
    """exp(mean NLL per token) over the user-turn target tokens only (the completion the SFT loss covers: the turn,
    END_MARKER on last turns, and the end-of-turn tokens), prompts as in `sft_example`; turns that do not fit
    `max_length` are left out, as in training. Not `trainer.evaluate`: the meter and the study read models outside
    any trainer, and this keeps logits for the completion positions only (`logits_to_keep`), not (B, T, vocab)."""
    import torch

    if not records:
        return math.nan
    examples, _ = sft_examples(records, tokenizer, max_context_tokens=max_context_tokens, max_length=max_length)
    encoded = [encode_example(tokenizer, ex) for ex in examples]
    if not encoded:
        return math.nan
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][0]))
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    total_nll, total_tokens = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for s in range(0, len(order), batch_size):
                batch = [encoded[i] for i in order[s : s + batch_size]]
                T = max(len(ids) for ids, _ in batch)
                # left padding puts every completion at the end: logits are needed for the last K positions only,
                # never the full (B, T, vocab) tensor
                input_ids = torch.tensor([[pad] * (T - len(ids)) + ids for ids, _ in batch], device=device)  # (B, T)
                attn = torch.tensor([[0] * (T - len(ids)) + [1] * len(ids) for ids, _ in batch], device=device)
                cmask = torch.tensor([[0] * (T - len(m)) + m for _, m in batch], device=device)  # (B, T)
                position_ids = (attn.cumsum(-1) - 1).clamp(min=0)  # as if unpadded, like training
                K = int(cmask.sum(-1).max().item()) + 1
                K = min(K, T)
                try:
                    out = model(input_ids=input_ids, attention_mask=attn, position_ids=position_ids,  # an index:
                                logits_to_keep=torch.arange(T - K, T, device=device))  # see generator.ending
                except TypeError:  # a model class without logits_to_keep
                    out = model(input_ids=input_ids, attention_mask=attn, position_ids=position_ids)
                logits = out.logits[:, -K:-1].float()  # (B, K-1, V): predicts tokens T-K+1 .. T-1
                targets = input_ids[:, T - K + 1 :]  # (B, K-1)
                mask = cmask[:, T - K + 1 :].bool()
                nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # (B, K-1)
                total_nll += float(nll[mask].sum())
                total_tokens += int(mask.sum())
    finally:
        if was_training:
            model.train()
    return math.exp(total_nll / total_tokens) if total_tokens else math.nan


# ---------------------------------------------------------------------------------------------------------------------
# training


def _load_records(args: SFTArgs, split: str) -> list[TurnRecord]:
    from generator.data import load_turns

    return load_turns(
        args.data,
        split,
        max_context_messages=args.max_context_messages,
        max_turn_chars=args.max_turn_chars,
        skip_first=args.skip_first,
        val_frac=args.val_frac,
        test_frac=args.test_frac,
    )


def _draw(records: list[TurnRecord], n: int, seed: int) -> list[TurnRecord]:
    records = list(records)
    random.Random(seed).shuffle(records)
    return records[:n]


def _write_info(folder: Path, args: SFTArgs, config, metrics: dict) -> None:
    info = {
        "prompt_format_version": PROMPT_FORMAT_VERSION,
        "end_marker": END_MARKER,
        "base_model": args.model,
        "max_context_tokens": args.max_context_tokens,
        "sft": _jsonable({k: v for k, v in metrics.items() if k.startswith(("ppl", "train", "n_"))}),
        "config": {"sft": to_jsonable(args), "trainer": to_jsonable(config)},
    }
    (folder / "generator_info.json").write_text(json.dumps(info, indent=2))


def make_trainer(args: SFTArgs, config, model, tokenizer, train_records: Sequence[TurnRecord], callbacks=None):
    """An SFTTrainer over the prompt-completion examples of `train_records` (the model is trained in place)."""
    from trl import SFTTrainer

    dataset = build_sft_dataset(train_records, tokenizer, max_context_tokens=args.max_context_tokens,
                                max_length=config.max_length)
    loss = token_loss(args.loss, tailr_gamma=args.tailr_gamma, mixce_eta=args.mixce_eta)
    before_another_trainer()
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=callbacks,
                         compute_loss_func=loss)
    # progress to stderr: stdout carries the CLI's JSON summary only
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(_stderr_log_callback())
    trainer.add_callback(_release_memory_callback(RELEASE_MEMORY_STEPS))
    return trainer


# on a CPU, glibc keeps the arenas that batches of every length leave behind: the warm start's resident memory grew
# from 4.0 to 5.9 GB over 40 steps of 8 turns; handing it back every 8 steps lowered a 64-step run's peak from 6.86 to
# 6.58 GB (every step: to 5.24 GB over 40, but 25% slower). docs/benchmarks.md
RELEASE_MEMORY_STEPS = 8


def _release_memory_callback(every: int):
    from transformers import TrainerCallback

    from conversations.memory import release_memory

    class ReleaseMemory(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if every and state.global_step % every == 0 and not str(args.device).startswith("cuda"):
                release_memory()
            return control

    return ReleaseMemory()


def _stderr_log_callback():
    """Trainer callback: one JSON line per log event on stderr."""
    import sys

    from transformers import TrainerCallback

    class StderrLog(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs:
                print(json.dumps({"step": state.global_step, **{k: _round(v) for k, v in logs.items()}}), file=sys.stderr)

    return StderrLog()


def _round(v):
    return round(v, 4) if isinstance(v, float) else v


def _gathered_state(trainer) -> dict | None:
    """Under DeepSpeed ZeRO-3 the trained model holds only this rank's shards (saved as is, every weight is empty:
    seen on an H200, where the next stage's load failed): its whole state dict gathered (a collective: every rank
    calls it; `zero3_save_16bit_model: true`). None otherwise: the model in hand is whole."""
    plugin = trainer.accelerator.state.deepspeed_plugin if getattr(trainer, "is_deepspeed_enabled", False) else None
    if plugin is None or plugin.zero_stage != 3:
        return None
    return trainer.accelerator.get_state_dict(trainer.model_wrapped)


def run_sft(
    args: SFTArgs,
    config=None,
    train_records: Sequence[TurnRecord] | None = None,
    eval_records: Sequence[TurnRecord] | None = None,
    callbacks=None,
) -> dict[str, Any]:
    """Fine-tune `args.model` on real user turns with TRL's SFTTrainer (`config`: an SFTConfig, default
    `sft_config()`). Records default to the train / val splits of `args.data`. Returns metrics: ppl_before, ppl_after
    (held-out real user turns), train_loss, train_runtime_s, n_train, n_eval, and the saved folders (adapter_dir,
    merged_dir, model_dir: the one to load next). The trainer's own files go to OUTPUT_DIR/trainer."""
    import torch

    from generator.model import (LoraSettings, count_trainable, load_generator, pick_device, prepare_training,
                                 training_dtype)

    t0 = time.time()
    config = config or sft_config()
    device = pick_device(args.device)
    out_dir = Path(config.output_dir)
    prepare_config(args, config, device)
    config.output_dir = str(out_dir / "trainer")
    n_train = args.train_turns or config.max_steps * config.per_device_train_batch_size * config.gradient_accumulation_steps
    if train_records is None:
        train_records = _draw(_load_records(args, "train"), n_train, config.seed)
    if eval_records is None:
        eval_records = (_draw(_load_records(args, "val"), args.eval_turns, seed_for("sft_eval_turns", config.seed))
                        if args.eval_turns else [])
    train_records, eval_records = list(train_records), list(eval_records)
    if not train_records:
        raise DataError("no training turns (check data, split fractions and max_turn_chars)", args.data)

    lora = (
        LoraSettings(r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout, target_modules=args.lora_target_modules)
        if args.use_lora
        else None
    )
    torch.manual_seed(config.seed)  # LoRA A matrices
    model, tokenizer = load_generator(
        args.model,
        lora=lora,
        dtype=training_dtype(args.dtype, device),
        device=device,
        gradient_checkpointing=config.gradient_checkpointing,
        trust_remote_code=config.trust_remote_code,
    )
    prepare_training(model, device, config.max_length)
    trainable, total = count_trainable(model)
    ppl_kw = dict(max_context_tokens=args.max_context_tokens, max_length=config.max_length)
    t_eval = time.time()
    ppl_before = heldout_perplexity(model, tokenizer, eval_records, args.eval_batch_size, **ppl_kw)
    eval_s = time.time() - t_eval

    out_dir.mkdir(parents=True, exist_ok=True)
    trainer = make_trainer(args, config, model, tokenizer, train_records, callbacks)
    t_train = time.time()
    result = trainer.train()
    train_s = time.time() - t_train
    model = trainer.model
    ppl_after = heldout_perplexity(model, tokenizer, eval_records, args.eval_batch_size, **ppl_kw)

    metrics: dict[str, Any] = {
        "model": args.model,
        "prompt_format_version": PROMPT_FORMAT_VERSION,
        "ppl_before": ppl_before,
        "ppl_after": ppl_after,
        "train_loss": float(result.training_loss),
        "train_steps": int(result.global_step),
        "train_runtime_s": round(train_s, 1),
        "eval_runtime_s": round(eval_s, 1),
        "n_train": len(train_records),
        # after leaving out turns that cannot fit max_length whole
        "n_train_used": len(trainer.train_dataset),
        "n_eval": len(eval_records),
        "n_train_ended": sum(r.is_last for r in train_records),
        "trainable_params": trainable,
        "total_params": total,
        "device": device,
        "loss_history": [
            {"step": h["step"], "loss": h["loss"]} for h in trainer.state.log_history if "loss" in h and "step" in h
        ],
    }
    adapter_dir = merged_dir = None
    # under several processes every rank trained the same model: the main process alone writes it
    main = trainer.is_world_process_zero()
    model = trainer.accelerator.unwrap_model(model)
    full_state = _gathered_state(trainer)
    if args.use_lora and args.save_adapter:
        adapter_dir = out_dir / "adapter"
        if main:
            model.save_pretrained(str(adapter_dir), state_dict=full_state)
            tokenizer.save_pretrained(str(adapter_dir))
            _write_info(adapter_dir, args, config, metrics)
    if args.save_merged or not args.use_lora:
        merged_dir = out_dir / "merged"
        if main:
            if full_state is not None:  # the trained model holds shards: merge a whole copy with the gathered weights
                model, _ = load_generator(args.model, lora=lora, dtype=training_dtype(args.dtype, device), device="cpu",
                                          trust_remote_code=config.trust_remote_code)
                model.load_state_dict(full_state)
            merged = model.merge_and_unload() if args.use_lora else model
            merged.save_pretrained(str(merged_dir), safe_serialization=True)
            tokenizer.save_pretrained(str(merged_dir))
            _write_info(merged_dir, args, config, metrics)
    trainer.accelerator.wait_for_everyone()
    metrics["adapter_dir"] = str(adapter_dir) if adapter_dir else None
    metrics["merged_dir"] = str(merged_dir) if merged_dir else None
    metrics["model_dir"] = metrics["merged_dir"] or metrics["adapter_dir"]
    metrics["wall_s"] = round(time.time() - t0, 1)
    if main:
        (out_dir / "sft_summary.json").write_text(json.dumps(_jsonable(metrics), indent=2))
    return metrics


def _jsonable(metrics: dict) -> dict:
    """NaN (no held-out turns) becomes null: JSON has no NaN."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in metrics.items()}


@friendly_errors
def main(argv: list[str] | None = None) -> dict:
    import sys

    from trl import SFTConfig

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    args, config = parse_config((SFTArgs, SFTConfig), argv, prog="python -m generator.sft", defaults=SFT_CONFIG_DEFAULTS)
    from conversations.cli_util import start_process

    start_process()
    metrics = run_sft(args, config)
    print(json.dumps(_jsonable(metrics), indent=2))
    return metrics


if __name__ == "__main__":
    main()
