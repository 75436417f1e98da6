"""The main job's configuration: `AdversaryConfig` (ours) beside TRL's `GRPOConfig` (optimiser, schedule, GRPO,
`output_dir`, `seed`, `report_to`, `max_steps`, `eval_steps`, `save_steps`, `trust_remote_code` (off unless asked
for; used for every model the job loads)). YAML files in `configs/` are presets of
both; any key can be overridden on the command line (`--key value`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from conversations.config import ConfigError

DETECTORS = ("classical", "style", "neural")


@dataclass
class AdversaryConfig:
    # ---- models and data
    model: str = field(default="smollm2-135m-instruct", metadata={
        "help": "User simulator: an embedded asset (smollm2-135m-instruct, tiny-random), a model id or a path."})
    discriminator: str = field(default="minilm-l6", metadata={
        "help": "Backbone of the co-trained discriminator: minilm-l6, tiny-random-encoder, a model id or a path."})
    data: str = field(default="sharegpt", metadata={
        "help": "Real conversations: 'sharegpt' (embedded), a JSON/JSONL file, a datasets folder or hf:NAME."})
    data_format: str = field(default="auto", metadata={"help": "auto, messages, sharegpt or wildchat."})
    skip_invalid: bool = field(default=True, metadata={"help": "Count and skip invalid records instead of stopping."})
    max_context_messages: int = field(default=2, metadata={"help": "Messages of context the simulator sees."})
    max_turn_chars: int = field(default=400, metadata={
        "help": "Train and evaluate on user turns up to this many characters (long pasted documents are a different task)."})
    max_context_tokens: int = field(default=256, metadata={"help": "Token budget of the simulator's prompt (left-truncated)."})
    dtype: str = field(default="auto", metadata={
        "help": "Precision of every stage: auto (bf16 on GPUs and on CPUs whose bf16 matmul is fast, measured once and "
                "cached; fp32 otherwise), bf16 or fp32. An explicit --bf16/--fp16 trainer flag means the same."})
    sim_temperature: float = field(default=1.0, metadata={
        "help": "Sampling temperature of the simulator outside GRPO: held-out evaluation, the discriminator's simulated "
                "turns, and the default the export records for its users."})
    sim_top_p: float = field(default=0.95, metadata={"help": "Nucleus mass of that sampling (1 turns it off)."})
    train_contexts: int = field(default=512, metadata={"help": "Training contexts for the adversarial phase."})

    # ---- LoRA of the generator
    lora_r: int = field(default=16, metadata={"help": "LoRA rank (0 trains every parameter)."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})

    # ---- stage 1: SFT warm start
    warmstart_steps: int = field(default=40, metadata={"help": "SFT steps on real user turns before the adversarial phase (0 skips)."})
    warmstart_batch_size: int = field(default=8, metadata={"help": "SFT batch size (sequences per optimiser step)."})
    warmstart_micro_batch: int = field(default=2, metadata={
        "help": "Sequences per forward pass; the rest is gradient accumulation. Logits over a 49k-token vocabulary and "
                "the activations dominate memory: SmolLM2 at 4 x 320 tokens peaked at 6.7 GB on the CPU, 8 x 320 over 9 GB."})
    warmstart_lr: float = field(default=2e-4, metadata={"help": "SFT learning rate."})
    warmstart_max_length: int = field(default=320, metadata={"help": "SFT sequence length in tokens (prompt + turn)."})

    # ---- stage 2: discriminator
    disc_init_items: int = field(default=192, metadata={"help": "Real and simulated turns (each) for the initial discriminator fit."})
    disc_epochs: int = field(default=2, metadata={"help": "Epochs of the initial fit."})
    disc_lr: float = field(default=3e-5, metadata={"help": "Discriminator learning rate."})
    disc_batch_size: int = field(default=16, metadata={"help": "Discriminator batch (half real, half simulated in updates)."})
    disc_max_length: int = field(default=192, metadata={"help": "Discriminator input tokens (context tail + turn)."})
    disc_context_tokens: int = field(default=96, metadata={"help": "Of those, tokens of context (truncated from the left)."})
    label_smoothing: float = field(default=0.1, metadata={"help": "Label smoothing of discriminator updates (keeps rewards from saturating)."})

    # ---- stage 3: adversarial GRPO
    d_every: int = field(default=1, metadata={"help": "Discriminator updates every this many generator steps."})
    d_steps: int = field(default=1, metadata={"help": "Balanced discriminator updates each time."})
    replay_size: int = field(default=512, metadata={"help": "Replay buffer of recent (context, simulated, real) triples."})
    disc_acc_ceiling: float = field(default=0.95, metadata={"help": "Skip discriminator updates while its recent accuracy is above this."})
    disc_acc_floor: float = field(default=0.6, metadata={"help": "Double the updates while its recent accuracy is below this."})
    reward_clip: float = field(default=5.0, metadata={"help": "Clip the discriminator's log-odds reward to [-clip, clip]."})
    w_disc: float = field(default=1.0, metadata={"help": "Weight of the discriminator reward."})
    w_length: float = field(default=0.5, metadata={"help": "Weight of the length-ratio term (penalises |log(len_sim/len_real)|)."})
    w_copy: float = field(default=0.5, metadata={"help": "Weight of the copying-from-context penalty."})
    w_assistant: float = field(default=0.5, metadata={"help": "Weight of the assistant-likeness penalty."})
    max_faults: int = field(default=5, metadata={"help": "Non-finite losses or rewards tolerated (steps skipped) before the run stops."})

    # ---- held-out Turing distance and the gate
    heldout_contexts: int = field(default=128, metadata={"help": "Held-out test-split contexts, one simulated turn each, per evaluation."})
    heldout_detectors: list[str] = field(default_factory=lambda: ["classical", "style"], metadata={
        "help": "Fresh detectors of the meter's panel (classical, style, neural); td is their maximum."})
    heldout_folds: int = field(default=5, metadata={"help": "Cross-fitting folds of the meter."})
    heldout_max_new_tokens: int = field(default=64, metadata={"help": "Token limit of a held-out simulated turn."})
    sim_batch_size: int = field(default=32, metadata={"help": "Contexts per generate call when simulating held-out and discriminator-fit turns (larger batches use the CPU's cores better; lower it if memory is short)."})
    heldout_merge_lora: bool = field(default=True, metadata={
        "help": "Simulate held-out turns with a merged copy of the LoRA generator (LoRA's extra matmuls cost ~20% of "
                "decoding on a CPU); the copy holds one more set of weights during an evaluation (0.5 GB for 135M, "
                "18 GB for 9B: turn it off on GPUs short of memory). Never under DeepSpeed or FSDP (sharded weights)."})
    eval_base_model: bool = field(default=False, metadata={"help": "Also measure the un-tuned base model's td (for comparison)."})
    gate_patience: int = field(default=3, metadata={"help": "Evaluations without improvement before the gate freezes."})
    gate_min_delta: float = field(default=1.0, metadata={"help": "Improvement in td points that resets patience."})
    gate_target_td: float = field(default=2.0, metadata={"help": "Freeze as soon as td is at or below this."})
    gate_smooth: int = field(default=2, metadata={"help": "Readings averaged for the plateau rule (damps noise)."})

    # ---- export
    export_dir: str | None = field(default=None, metadata={"help": "Where the frozen simulator goes (default OUTPUT_DIR/frozen)."})

    def __post_init__(self):
        checks = [
            (self.max_context_messages >= 1, "max_context_messages must be >= 1"),
            (self.max_turn_chars >= 10, "max_turn_chars must be >= 10"),
            (self.train_contexts >= 1, "train_contexts must be >= 1"),
            (self.lora_r >= 0, "lora_r must be >= 0 (0 trains every parameter)"),
            (self.warmstart_steps >= 0, "warmstart_steps must be >= 0 (0 skips the warm start)"),
            (self.warmstart_micro_batch >= 1 and self.warmstart_batch_size % self.warmstart_micro_batch == 0,
             "warmstart_batch_size must be a multiple of warmstart_micro_batch"),
            (self.disc_init_items >= 8, "disc_init_items must be >= 8"),
            (self.sim_batch_size >= 1, "sim_batch_size must be >= 1"),
            (self.d_every >= 1 and self.d_steps >= 0, "d_every must be >= 1 and d_steps >= 0"),
            (self.disc_context_tokens < self.disc_max_length, "disc_context_tokens must be smaller than disc_max_length"),
            (0 <= self.label_smoothing < 0.5, "label_smoothing must be in [0, 0.5)"),
            (0.5 <= self.disc_acc_floor < self.disc_acc_ceiling <= 1.0, "need 0.5 <= disc_acc_floor < disc_acc_ceiling <= 1"),
            (self.reward_clip > 0, "reward_clip must be > 0"),
            (min(self.w_disc, self.w_length, self.w_copy, self.w_assistant) >= 0, "reward weights must be >= 0"),
            (self.heldout_contexts >= 20, "heldout_contexts must be >= 20 (the meter needs 20 items a side)"),
            (self.heldout_folds >= 2, "heldout_folds must be >= 2"),
            (self.gate_patience >= 1 and self.gate_smooth >= 1, "gate_patience and gate_smooth must be >= 1"),
            (self.max_faults >= 0, "max_faults must be >= 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(f"{msg}; fix it in the YAML config or with --{msg.split()[0]} on the command line")
        from conversations.precision import normalise_dtype

        self.dtype = normalise_dtype(self.dtype)
        if self.sim_temperature <= 0 or not 0 < self.sim_top_p <= 1:
            raise ConfigError("need sim_temperature > 0 and 0 < sim_top_p <= 1; fix it in the YAML config or with "
                              "--sim_temperature / --sim_top_p on the command line")
        bad = [d for d in self.heldout_detectors if d not in DETECTORS]
        if bad or not self.heldout_detectors:
            raise ConfigError(f"heldout_detectors: unknown {bad} (choose from {', '.join(DETECTORS)})")


def parse_job(extra_types: tuple, argv, prog: str, default_config=None):
    """(AdversaryConfig, GRPOConfig, *extra) from `--config FILE.yaml` (default `default_config`) and `--key value`
    overrides, with the run's one precision resolved and applied to the trainer config: every stage of the process
    (warm start, GRPO, the study's arms) must agree on it, since the first trainer fixes accelerate's process-wide
    mixed precision."""
    import sys

    from trl import GRPOConfig

    from conversations.config import given_keys, parse_config
    from conversations.precision import apply_precision, run_precision

    argv = list(sys.argv[1:] if argv is None else argv)
    if default_config is not None and "--config" not in argv:
        argv = ["--config", str(default_config)] + argv
    cfg, args, *extra = parse_config((AdversaryConfig, GRPOConfig, *extra_types), argv, prog=prog)
    cfg.dtype = run_precision(cfg.dtype, args, given_keys(argv))
    apply_precision(args, cfg.dtype)
    return (cfg, args, *extra)
