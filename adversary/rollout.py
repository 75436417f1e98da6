"""GRPO's rollouts on the generation engine: TRL's `rollout_func` (`EngineRollout`), used by `adversary.loop`."""

from __future__ import annotations

from conversations.config import ConfigError
from conversations.seeds import derive_seed
from generator.engine import SamplingSettings, policy_engine, stop_token_ids


class EngineRollout:
    """TRL `rollout_func` for `GRPOTrainer` on plain-text prompts: the group's completions are sampled by this engine
    from a merged inference copy of the policy (`policy_engine`) instead of `model.generate` over the LoRA-wrapped
    training weights. The same distribution (temperature, top-p, top-k as TRL's `GRPOConfig` says), stopping at the
    engine's stop tokens (the trainer's `eos_token_ids` are widened to them, so `mask_truncated_completions` reads a
    turn that ended on `<|im_start|>` as ended). Log-probs are left to TRL to recompute (`logprobs: None`).
    Why: on 2 CPU cores a GRPO step's generation took most of the step through `generate` (LoRA's extra matmuls,
    autocast re-casting every weight at every token, no shared prefix); docs/benchmarks.md has the step times."""

    def __init__(self, tokenizer, settings: SamplingSettings, *, precision: str = "fp32", batch_size: int = 64,
                 seed: int = 0, merge_lora: bool = True):
        self.tokenizer, self.settings, self.precision = tokenizer, settings, precision
        self.batch_size, self.seed, self.merge_lora = batch_size, seed, merge_lora

    @staticmethod
    def settings_from(args) -> SamplingSettings:
        """The engine's settings for a TRL `GRPOConfig`; raises ConfigError for what the engine does not sample with
        (min_p, a repetition penalty): keep `grpo_rollout: trl` for those."""
        extra = dict(args.generation_kwargs or {})
        if getattr(args, "min_p", None) or (getattr(args, "repetition_penalty", 1.0) or 1.0) != 1.0:
            raise ConfigError("grpo_rollout: engine samples with temperature, top_p and top_k only; unset min_p and "
                              "repetition_penalty or set grpo_rollout: trl")
        return SamplingSettings(max_new_tokens=args.max_completion_length, temperature=args.temperature,
                                top_p=args.top_p if args.top_p is not None else 1.0, top_k=int(args.top_k or 0),
                                min_new_tokens=int(extra.get("min_new_tokens", 0)))

    def widen_stops(self, trainer) -> None:
        """Make the trainer read every engine stop token as an end of turn."""
        model = trainer.accelerator.unwrap_model(trainer.model)
        trainer.eos_token_ids = sorted(set(trainer.eos_token_ids) | set(stop_token_ids(self.tokenizer, model)))

    def __call__(self, prompts: list, trainer) -> dict:
        # tokenized as TRL tokenizes a plain-text prompt
        prompt_ids = self.tokenizer(text=list(prompts))["input_ids"]
        step, rank = trainer.state.global_step, trainer.accelerator.process_index
        with policy_engine(trainer, self.tokenizer, precision=self.precision, batch_size=self.batch_size,
                           merge_lora=self.merge_lora, gather_zero3=trainer.args.ds3_gather_for_generation,
                           stop_ids=trainer.eos_token_ids) as engine:
            # differs per step and per process: a repeated prompt must not replay the same random stream
            out = engine.complete(prompt_ids, self.settings, seed=derive_seed(self.seed, step=step, rank=rank))
        return {"prompt_ids": prompt_ids, "completion_ids": [c.ids for c in out], "logprobs": None}
