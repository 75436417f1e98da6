"""The main job's configuration: `AdversaryConfig` (ours) beside TRL's `GRPOConfig` (optimiser, schedule, GRPO,
`output_dir`, `seed`, `report_to`, `max_steps`, `eval_steps`, `save_steps`, `trust_remote_code` (off unless asked
for; used for every model the job loads)). YAML files in `configs/` are presets of both; any key can be overridden
on the command line (`--key value`).

`AdversaryConfig` is composed of typed parts, one per concern, each declared and checked in one place: `ModelArgs`
(with `generator.model.LoraArgs`), `DataArgs`, `SamplingArgs`, `WarmStartArgs`, `DiscriminatorArgs`,
`ObjectiveArgs`, `MeterArgs`, `GateArgs`, `ExportArgs` (`PARTS`). Keys stay flat in presets and on the command line
(each belongs to one part); the resolved config is saved grouped by part (`resolved`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from conversations.config import ConfigError
from generator.model import LoraArgs
from generator.token_losses import TOKEN_LOSSES

DETECTORS = ("classical", "style", "neural", "embed", "lmjudge")
CONV_READINGS = ("every", "first_and_best", "best")
# every numeric field's natural range (conversations.config.check_ranges: one message naming the key)
RANGES = {
    "max_context_messages": ">= 1", "max_turn_chars": ">= 10", "max_context_tokens": ">= 16", "train_contexts": ">= 1",
    "lora_r": ">= 0", "lora_alpha": "> 0", "lora_dropout": "[0, 1)", "warmstart_steps": ">= 0",
    "warmstart_batch_size": ">= 1", "warmstart_micro_batch": ">= 1", "warmstart_lr": "> 0",
    "warmstart_max_length": ">= 32", "disc_init_items": ">= 8", "disc_epochs": ">= 1", "disc_lr": "> 0",
    "disc_batch_size": ">= 2", "disc_max_length": ">= 32", "disc_context_tokens": ">= 0", "label_smoothing": "[0, 0.5)",
    "disc_pool_size": ">= 16", "d_every": ">= 1", "d_steps": ">= 0", "replay_size": ">= 1",
    "disc_acc_ceiling": "(0.5, 1]", "disc_acc_floor": "[0.5, 1)", "reward_clip": "> 0", "w_disc": ">= 0",
    "w_length": ">= 0", "length_band": ">= 0", "w_copy": ">= 0", "w_assistant": ">= 0", "max_faults": ">= 0", "phase_seconds": ">= 0",
    "round_contexts": ">= 1", "round_samples": ">= 2", "round_min_margin": ">= 0", "max_rounds": ">= 0",
    "eval_rounds": ">= 1", "dpo_beta": "> 0", "dpo_lr": "> 0", "dpo_sft_weight": ">= 0", "dpo_batch_size": ">= 1",
    "dpo_micro_batch": ">= 1", "spin_epochs": ">= 1", "spin_history": ">= 0",
    "resample_candidates": ">= 2", "resample_real_share": "[0, 1]",
    "distill_candidates": ">= 2", "distill_lr": "> 0", "distill_real_weight": ">= 0", "distill_weight": ">= 0",
    "distill_epochs": ">= 1", "distill_top_p": "(0, 1]", "dpg_log_ratio_clip": "> 0", "bond_beta": "[0, 1]",
    "tailr_gamma": "[0, 1]", "mixce_eta": "[0, 1]", "heldout_contexts": ">= 20", "heldout_folds": ">= 2", "meter_seeds": ">= 1", "heldout_max_new_tokens": ">= 1",
    "sim_batch_size": ">= 1", "sim_temperature": "> 0", "sim_top_p": "(0, 1]", "gate_patience": ">= 1",
    "gate_min_delta": ">= 0", "gate_target_td": "[0, 50]", "gate_smooth": ">= 1", "conv_contexts": ">= 0",
    "conv_max_turns": ">= 1", "end_calibration_contexts": ">= 8", "export_guidance": ">= 1",
    "export_guide_contexts": ">= 64", "export_report_seeds": ">= 1",
}


class ConfigPart:
    """One typed part of the main job's config. Each part checks its own keys (`check_part`: the ranges of RANGES it
    owns, then its `_checks`), standalone or inside the composed `AdversaryConfig`; a check that spans parts is the
    composition's."""

    def __post_init__(self):
        check_part(self, type(self))

    def _checks(self) -> list:
        """[(ok, key, what is wrong)]; may raise a ConfigError itself."""
        return []


def own_fields(part: type) -> list[str]:
    """The fields a part declares itself (not those it inherits), in order."""
    import dataclasses

    inherited = {f.name for base in part.__bases__ if dataclasses.is_dataclass(base) for f in dataclasses.fields(base)}
    return [f.name for f in dataclasses.fields(part) if f.name not in inherited]


def check_part(obj, part: type) -> None:
    from conversations.config import check_ranges

    names = own_fields(part)
    check_ranges(obj, {k: v for k, v in RANGES.items() if k in names})
    for ok, key, msg in part._checks(obj):
        if not ok:
            raise ConfigError(f"{msg}; fix it in the YAML config or with --{key} on the command line")


@dataclass
class ModelArgs(LoraArgs, ConfigPart):
    """The simulator's model, its precision and its LoRA (`generator.model.LoraArgs`)."""

    model: str = field(default="smollm2-135m-instruct", metadata={
        "help": "User simulator: an embedded asset (smollm2-135m-instruct, gemma3-270m, tiny-random), a model id or a path."})
    dtype: str = field(default="auto", metadata={
        "help": "Precision of every stage: auto (bf16 on GPUs and on CPUs whose bf16 matmul is fast, measured once and "
                "cached; fp32 otherwise), bf16 or fp32. An explicit --bf16/--fp16 trainer flag means the same."})

    def _checks(self) -> list:
        from conversations.assets import check_model_name
        from conversations.config import check_ranges
        from conversations.precision import normalise_dtype

        check_ranges(self, {k: RANGES[k] for k in ("lora_r", "lora_alpha", "lora_dropout")})  # LoraArgs' own
        check_model_name(self.model, "model")
        self.dtype = normalise_dtype(self.dtype)
        return []


@dataclass
class DataArgs(ConfigPart):
    """Real conversations and how they are cut into contexts and turns."""

    data: str = field(default="sharegpt", metadata={
        "help": "Real conversations: 'sharegpt' (embedded), a JSON/JSONL file, a datasets folder or hf:NAME."})
    data_format: str = field(default="auto", metadata={"help": "auto, messages, sharegpt or wildchat."})
    skip_invalid: bool = field(default=True, metadata={"help": "Count and skip invalid records instead of stopping."})
    max_context_messages: int = field(default=2, metadata={"help": "Messages of context the simulator sees."})
    max_turn_chars: int = field(default=400, metadata={
        "help": "Train and evaluate on user turns up to this many characters (long pasted documents are a different task)."})
    max_context_tokens: int = field(default=256, metadata={"help": "Token budget of the simulator's prompt (left-truncated)."})
    train_contexts: int = field(default=512, metadata={"help": "Training contexts for the adversarial phase."})


@dataclass
class SamplingArgs(ConfigPart):
    """How the simulator samples outside GRPO: held-out readings, the discriminator's simulated turns, the rounds,
    and the settings the export records."""

    sim_temperature: float = field(default=1.0, metadata={
        "help": "Sampling temperature of the simulator outside GRPO: held-out evaluation, the discriminator's simulated "
                "turns, and the default the export records for its users."})
    sim_top_p: float = field(default=0.95, metadata={"help": "Nucleus mass of that sampling (1 turns it off)."})
    heldout_max_new_tokens: int = field(default=64, metadata={"help": "Token limit of a held-out simulated turn."})
    sim_batch_size: int = field(default=32, metadata={"help": "Contexts per generate call when simulating held-out and discriminator-fit turns (larger batches use the CPU's cores better; lower it if memory is short)."})
    heldout_merge_lora: bool = field(default=True, metadata={
        "help": "Simulate held-out turns with a merged copy of the LoRA generator (LoRA's extra matmuls cost ~20% of "
                "decoding on a CPU); the copy holds one more set of weights during an evaluation (0.5 GB for 135M, "
                "18 GB for 9B: turn it off on GPUs short of memory). Never under DeepSpeed or FSDP (sharded weights)."})


@dataclass
class WarmStartArgs(ConfigPart):
    """Stage 1: the SFT warm start (and the SFT loss of the study's continued-SFT arms)."""

    warmstart_steps: int = field(default=40, metadata={"help": "SFT steps on real user turns before the adversarial phase (0 skips)."})
    warmstart_batch_size: int = field(default=8, metadata={"help": "SFT batch size (sequences per optimiser step)."})
    warmstart_micro_batch: int = field(default=2, metadata={
        "help": "Sequences per forward pass; the rest is gradient accumulation. Logits over a 49k-token vocabulary and "
                "the activations dominate memory: SmolLM2 at 4 x 320 tokens peaked at 6.7 GB on the CPU, 8 x 320 over 9 GB."})
    warmstart_lr: float = field(default=2e-4, metadata={"help": "SFT learning rate."})
    warmstart_max_length: int = field(default=320, metadata={"help": "SFT sequence length in tokens (prompt + turn)."})
    sft_loss: str = field(default="nll", metadata={
        "help": "Loss of the SFT stages (warm start, the study's continued-SFT arms): nll; tailr (TaiLr: each "
                "token's NLL weighted by p / (tailr_gamma + (1 - tailr_gamma) p), the model's probability of it, "
                "detached); or mixce (MixCE: weighted by mixce_eta + (1 - mixce_eta) p). tailr and mixce are the "
                "non-adversarial controls that cost what SFT costs."})
    tailr_gamma: float = field(default=0.5, metadata={"help": "tailr: gamma (0 is plain NLL; 1 weights by p)."})
    mixce_eta: float = field(default=0.5, metadata={
        "help": "mixce: the forward cross-entropy's share (1 is plain NLL; 0 weights every token by p, the reverse "
                "cross-entropy's self-reinforced approximation alone)."})

    def _checks(self) -> list:
        return [(self.warmstart_batch_size % self.warmstart_micro_batch == 0, "warmstart_batch_size",
                 "warmstart_batch_size must be a multiple of warmstart_micro_batch"),
                (self.sft_loss in TOKEN_LOSSES, "sft_loss", f"sft_loss must be one of {', '.join(TOKEN_LOSSES)}")]


@dataclass
class DiscriminatorArgs(ConfigPart):
    """Stage 2 and co-training: the discriminator, its fit, its updates and its reward."""

    discriminator: str = field(default="minilm-l6", metadata={
        "help": "Backbone of the co-trained discriminator: minilm-l6, tiny-random-encoder, a model id or a path."})
    disc_family: str = field(default="ensemble", metadata={"help": "The neural member: ensemble (a NeuralDetector on "
        "`discriminator`) or lmjudge (discriminator.lm_judge: a causal LM, its own LoRA and head, Bradley-Terry on pairs)."})
    judge_backbone: str = field(default="", metadata={"help": "lmjudge: its causal LM ('' = the generator's `model`)."})
    judge_init: str = field(default="", metadata={"help": "lmjudge: a judge LMJudge.save wrote (adversary.judge_study's "
        "OUT/lmjudge, fitted on this warm start's turns) instead of fitting it here; an n-gram member is still fitted ('' = fit here)."})
    disc_init_items: int = field(default=192, metadata={"help": "Real and simulated turns (each) for the initial discriminator fit."})
    disc_epochs: int = field(default=2, metadata={"help": "Epochs of the initial fit."})
    disc_lr: float = field(default=3e-5, metadata={"help": "Discriminator learning rate."})
    disc_batch_size: int = field(default=16, metadata={"help": "Discriminator batch (half real, half simulated in updates)."})
    disc_max_length: int = field(default=192, metadata={"help": "Discriminator input tokens (context tail + turn)."})
    disc_context_tokens: int = field(default=96, metadata={"help": "Of those, tokens of context (truncated from the left)."})
    label_smoothing: float = field(default=0.1, metadata={"help": "Label smoothing of discriminator updates (keeps rewards from saturating)."})
    disc_weights: list[float] = field(default_factory=lambda: [1.0, 1.0], metadata={
        "help": "Weights of the discriminator's two members in its log-odds: [neural (the `discriminator` backbone, "
                "updated online), classical (char/word n-gram logistic regression, refit on its pool)]; 0 leaves one out."})
    disc_pool_size: int = field(default=4096, metadata={"help": "Newest labelled turns the classical member is refit on."})
    disc_sees_end: bool = field(default=False, metadata={
        "help": "The discriminator sees the end decision: a turn that ends its conversation (the real user's last, a "
                "simulated one that wrote the end marker) carries the marker in what the discriminator is fitted on "
                "and scores (the rounds objectives and the initial fit; GRPO's rewards read turns without it)."})
    disc_reward: str = field(default="logit", metadata={
        "help": "The discriminator reward from its log-odds z: logit = clip(z, +-reward_clip); log_d = log sigmoid(z) "
                "clipped below at -reward_clip (non-saturating, no reward for 'more real than real'); pairwise = "
                "min(0, z(own turn) - z(the context's real turn)) clipped below at -reward_clip (Turing-RL's capped "
                "pairwise reward: 0 is 'cannot tell', nothing for 'more human than the human')."})
    d_every: int = field(default=1, metadata={"help": "Discriminator updates every this many generator steps."})
    d_steps: int = field(default=1, metadata={"help": "Balanced discriminator updates each time."})
    replay_size: int = field(default=512, metadata={"help": "Replay buffer of recent (context, simulated, real) triples."})
    disc_acc_ceiling: float = field(default=0.95, metadata={"help": "Skip discriminator updates while its recent accuracy is above this."})
    disc_acc_floor: float = field(default=0.6, metadata={"help": "Double the updates while its recent accuracy is below this."})
    reward_clip: float = field(default=5.0, metadata={"help": "Clip the discriminator's log-odds reward to [-clip, clip]."})

    def _checks(self) -> list:
        from conversations.assets import check_model_name

        check_model_name(self.discriminator, "discriminator")
        return [(self.disc_context_tokens <= self.disc_max_length - 16, "disc_context_tokens",
                 "disc_context_tokens must leave 16 tokens of disc_max_length for the turn"),
                (self.disc_acc_floor < self.disc_acc_ceiling, "disc_acc_floor",
                 "disc_acc_floor must be below disc_acc_ceiling"),
                (self.disc_reward in ("logit", "log_d", "pairwise"), "disc_reward",
                 "disc_reward must be logit, log_d or pairwise"),
                (self.disc_family in ("ensemble", "lmjudge"), "disc_family", "disc_family must be ensemble or lmjudge"),
                (not self.judge_init or Path(self.judge_init, "discriminator.json").exists(),
                 "judge_init", f"judge_init {self.judge_init!r} is not a folder LMJudge.save wrote (no discriminator.json)"),
                (len(self.disc_weights) == 2 and min(self.disc_weights) >= 0 and max(self.disc_weights) > 0,
                 "disc_weights", "disc_weights must be two weights >= 0 (neural, classical), not both 0")]


@dataclass
class ObjectiveArgs(ConfigPart):
    """Stage 3: the adversarial objective (one file each in adversary/objectives/) and its keys."""

    objective: str = field(default="grpo", metadata={
        "help": "How the generator learns against the discriminator: grpo (TRL GRPOTrainer, reward = discriminator + "
                "realism terms) or dpo_rounds (rounds of: sample round_samples turns per context, the discriminator "
                "picks chosen/rejected, one epoch of TRL DPO on the LoRA adapter; adversary/rounds.py)."})
    grpo_rollout: str = field(default="engine", metadata={
        "help": "grpo: who samples the group's completions: engine (adversary.rollout.EngineRollout on a merged "
                "inference copy, through TRL's rollout_func) or trl (TRL's own model.generate, or vLLM with "
                "use_vllm). With use_vllm or under FSDP, TRL's own generation is used either way."})
    phase_seconds: float = field(default=0.0, metadata={
        "help": "Wall-time budget of the adversarial phase in seconds (0: none; the step/round budget still holds)."})
    max_faults: int = field(default=5, metadata={"help": "Non-finite losses or rewards tolerated (steps skipped) before the run stops."})
    w_disc: float = field(default=1.0, metadata={"help": "Weight of the discriminator reward."})
    w_length: float = field(default=0.5, metadata={"help": "Weight of the length-ratio term (penalises |log(len_sim/len_real)|)."})
    length_band: float = field(default=0.0, metadata={"help": "> 1: the length term is 0 within [real / band, real x "
        "band] characters of the context's real turn, -(|log ratio| - log band) outside; 0: the plain -|log ratio|."})
    w_copy: float = field(default=0.5, metadata={"help": "Weight of the copying-from-context penalty."})
    w_assistant: float = field(default=0.5, metadata={"help": "Weight of the assistant-likeness penalty."})
    round_contexts: int = field(default=64, metadata={"help": "The rounds objectives (dpo_rounds, spin, resample_sft): training contexts per round."})
    round_samples: int = field(default=4, metadata={"help": "dpo_rounds, spin: turns sampled per context."})
    round_chosen: str = field(default="sample", metadata={
        "help": "dpo_rounds: the chosen turn of a pair: sample (the most real-looking sample) or real (the real turn); "
                "the rejected one is always the least real-looking sample."})
    round_min_margin: float = field(default=0.0, metadata={
        "help": "dpo_rounds: drop pairs whose discriminator log-odds differ by less than this."})
    max_rounds: int = field(default=0, metadata={"help": "The rounds objectives: rounds at most (0: until max_steps or phase_seconds)."})
    eval_rounds: int = field(default=1, metadata={"help": "The rounds objectives: held-out td every this many rounds."})
    dpo_beta: float = field(default=0.1, metadata={"help": "dpo_rounds: DPO beta (reference: the policy at the round's start)."})
    dpo_lr: float = field(default=5e-5, metadata={"help": "dpo_rounds: learning rate of the LoRA adapter."})
    dpo_sft_weight: float = field(default=0.0, metadata={
        "help": "dpo_rounds: weight of an NLL term on the chosen turn beside DPO (TRL loss_type [sigmoid, sft], RPO)."})
    dpo_batch_size: int = field(default=8, metadata={"help": "dpo_rounds: pairs per optimiser step."})
    dpo_micro_batch: int = field(default=4, metadata={"help": "dpo_rounds: pairs per forward pass (the rest accumulates)."})
    dpo_checkpointing: bool = field(default=True, metadata={"help": "dpo_rounds: recompute each layer's activations in the backward pass instead of keeping them (a round of the demo's shapes peaked at 2.7 GB with it, 3.5 without, for 15-20% more DPO time in a probe; docs/benchmarks.md)."})
    dpo_loss: str = field(default="sigmoid", metadata={
        "help": "dpo_rounds, spin: the preference loss (TRL loss_type): sigmoid (DPO) or apo_zero (anchored: raises "
                "the chosen turn's likelihood and lowers the rejected one's, each against the reference)."})
    spin_epochs: int = field(default=2, metadata={
        "help": "spin: epochs over the pairs of each iteration (SPIN trains each iteration's data for 2-3)."})
    spin_history: int = field(default=0, metadata={
        "help": "spin: earlier iterations whose pairs each iteration trains on beside its own (0: all of them)."})
    resample_candidates: int = field(default=8, metadata={
        "help": "resample_sft: turns sampled per context; one is kept with probability proportional to the "
                "discriminator's D/(1-D) (self-normalised importance resampling, adversary.guidance)."})
    resample_real_share: float = field(default=0.5, metadata={
        "help": "resample_sft: share of each round's SFT examples that are real turns (the rest: resampled ones)."})
    distill_candidates: int = field(default=4, metadata={
        "help": "dpg, bond (adversary.distill): own samples per context each round (K)."})
    distill_lr: float = field(default=2e-4, metadata={
        "help": "dpg, bond: learning rate of the LoRA adapter (AdamW, kept across rounds; the warm start's 2e-4)."})
    distill_real_weight: float = field(default=1.0, metadata={
        "help": "dpg, bond: weight of the NLL of each round context's real turn beside the distillation term (0: none)."})
    distill_weight: float = field(default=1.0, metadata={
        "help": "dpg, bond: scale of the own samples' coefficients (0: the round is SFT on its real turns alone)."})
    distill_epochs: int = field(default=1, metadata={"help": "dpg, bond: passes over each round's weighted turns."})
    distill_top_p: float = field(default=1.0, metadata={
        "help": "dpg, bond: nucleus mass of the round's samples, drawn at T 1 (1: the policy's own distribution, "
                "which dpg's importance weights assume)."})
    dpg_log_ratio_clip: float = field(default=3.0, metadata={
        "help": "dpg: |log a(x) - log pi(x)| (warm start against policy) clipped at this (truncated importance weights)."})
    bond_beta: float = field(default=0.5, metadata={
        "help": "bond: weight of the backward-KL term (quantile-reward policy gradient) against the forward one "
                "(NLL of the best of K): 0 is best-of-K SFT, 0.5 BOND's Jeffreys mixture."})

    def _checks(self) -> list:
        from adversary.objectives import available

        return [(self.objective in available(), "objective",
                 f"objective must be one of {', '.join(available())} (adversary/objectives/)"),
                (self.round_chosen in ("sample", "real"), "round_chosen", "round_chosen must be sample or real"),
                (self.grpo_rollout in ("engine", "trl"), "grpo_rollout", "grpo_rollout must be engine or trl"),
                (self.dpo_loss in ("sigmoid", "apo_zero"), "dpo_loss", "dpo_loss must be sigmoid or apo_zero"),
                (self.dpo_batch_size % self.dpo_micro_batch == 0, "dpo_batch_size",
                 "dpo_batch_size must be a multiple of dpo_micro_batch")]


@dataclass
class MeterArgs(ConfigPart):
    """Stage 4: the held-out meter (fresh detectors, turn and conversation level, the end decision)."""

    heldout_contexts: int = field(default=128, metadata={"help": "Held-out test-split contexts, one simulated turn each, per evaluation."})
    heldout_detectors: list[str] = field(default_factory=lambda: ["classical", "style"], metadata={
        "help": "Fresh detectors of the meter's panel (classical, style, neural); td is their maximum."})
    heldout_folds: int = field(default=5, metadata={"help": "Cross-fitting folds of the meter."})
    meter_seeds: int = field(default=2, metadata={
        "help": "Independent samples per held-out context at every reading, each list read by its own panel, the "
                "reading their mean td (one sample's reading moves by sd ~2 with the sampling alone on 256 contexts, "
                "bench/bench_td_spread.py; the mean of 2 by ~1.4). Drawn in one call, each context prefilled once "
                "(as n sampling seeds would draw them, for one prefill). 1 reads one sample."})
    eval_base_model: bool = field(default=False, metadata={"help": "Also measure the un-tuned base model's td (for comparison)."})
    conv_contexts: int = field(default=0, metadata={
        "help": "Held-out real conversations the meter continues at every reading (adversary.conversation_meter): "
                "conversation-level td (conv/td), termination F1, ends and turns per real, beside the turn-level "
                "reading; 0 reads turns only."})
    conv_max_turns: int = field(default=4, metadata={"help": "Simulated user turns per held-out conversation at most."})
    end_decision: str = field(default="sampled", metadata={
        "help": "How the simulator's turns end a conversation: sampled (the end marker sampled with the text) or "
                "calibrated (the decision drawn from the simulator's own P(end | context, turn) at a logit offset "
                "solved at every reading so that its end rate on train contexts is the real users' rate inside the "
                "conversation window; generator.ending). The conversation level and the export use it."})
    end_calibration_contexts: int = field(default=64, metadata={
        "help": "Train contexts (after an opening) the calibrated end decision's offset is solved on at each reading."})
    conv_readings: str = field(default="every", metadata={
        "help": "Which readings continue the held-out conversations (and solve the end offset): every reading; "
                "first_and_best: the first reading, then the best checkpoint's once after the phase (the export's "
                "end offset comes from it); best: the best checkpoint's only. The conversation level is ~46% of a "
                "reading's time on 2 CPU cores (bench/bench_meter_reading.py); the gate must read turns then."})

    def _checks(self) -> list:
        bad = [d for d in self.heldout_detectors if d not in DETECTORS]
        if bad or not self.heldout_detectors:
            raise ConfigError(f"heldout_detectors: unknown {bad} (choose from {', '.join(DETECTORS)})")
        return [(self.end_decision in ("sampled", "calibrated"), "end_decision",
                 "end_decision must be sampled or calibrated"),
                (self.conv_readings in CONV_READINGS, "conv_readings",
                 f"conv_readings must be one of {', '.join(CONV_READINGS)}")]


@dataclass
class GateArgs(ConfigPart):
    """Stage 5: the gate that freezes the generator at a plateau."""

    gate_patience: int = field(default=3, metadata={"help": "Evaluations without improvement before the gate freezes."})
    gate_min_delta: float = field(default=1.0, metadata={"help": "Improvement in td points that resets patience."})
    gate_target_td: float = field(default=2.0, metadata={"help": "Freeze as soon as td is at or below this."})
    gate_smooth: int = field(default=2, metadata={"help": "Readings averaged for the plateau rule (damps noise)."})
    gate_level: str = field(default="turn", metadata={
        "help": "Which reading the gate freezes on and picks the best checkpoint by: turn (td/panel) or "
                "conversation (conv/td; needs conv_contexts >= 20)."})

    def _checks(self) -> list:
        return [(self.gate_level in ("turn", "conversation"), "gate_level", "gate_level must be turn or conversation")]


@dataclass
class ExportArgs(ConfigPart):
    """Stage 6: the export and its guide."""

    export_dir: str | None = field(default=None, metadata={"help": "Where the frozen simulator goes (default OUTPUT_DIR/frozen)."})
    export_guidance: int = field(default=1, metadata={
        "help": "K > 1: the export carries a guide, a calibrated discriminator (the classical member, the family whose "
                "signal reached fresh detectors in the go/no-go) fitted on the exported simulator's own turns, and its "
                "users keep one of K sampled turns by it (`adversary.guidance`; `frozen:DIR#guidance=1` turns it "
                "off). 1: no guide."})
    export_guide_contexts: int = field(default=1024, metadata={
        "help": "Train contexts (the discriminator-fit ones, then fresh ones) whose real turns and the export's own turns "
                "fit the guide; a quarter of their conversations is held back to calibrate it."})
    export_guide_rule: str = field(default="resample", metadata={
        "help": "How the guide keeps one of K: resample (by D/(1-D), the rule that held its length at the real "
                "median) or argmax."})
    export_report_seeds: int = field(default=1, metadata={"help": "Sampling seeds of the shipped export's reading "
        "(the meter's seeds 0..n-1; a guided export samples K turns a context for each)."})
    export_report: bool = field(default=True, metadata={"help": "After the export: read it as its users get it (its "
        "guide, its sampling) on the held-out contexts, draw it on the curve, write its report (README.md: adversary.card)."})
    export_report_conversations: bool = field(default=True, metadata={"help": "The shipped reading at the conversation "
        "level too, where the run reads conversations (conv_contexts): a guided export samples K turns a user turn."})

    def _checks(self) -> list:
        return [(self.export_guide_rule in ("resample", "argmax"), "export_guide_rule",
                 "export_guide_rule must be resample or argmax")]


# the parts in the order they are saved (the resolved config of every run, checkpoint and export)
PARTS = {"model": ModelArgs, "data": DataArgs, "sampling": SamplingArgs, "warmstart": WarmStartArgs,
         "discriminator": DiscriminatorArgs, "objective": ObjectiveArgs, "meter": MeterArgs, "gate": GateArgs,
         "export": ExportArgs}


@dataclass
class AdversaryConfig(ExportArgs, GateArgs, MeterArgs, ObjectiveArgs, DiscriminatorArgs, WarmStartArgs, SamplingArgs,
                      DataArgs, ModelArgs):  # the reverse of PARTS: dataclass fields come in the order model ... export
    """Every key of the main job but the trainer's: the parts above composed side by side (a YAML preset and the
    command line stay flat: each key belongs to exactly one part, `cfg.part("gate")` is that part alone).
    TRL's GRPOConfig is parsed beside it."""

    def __post_init__(self):
        for part in PARTS.values():
            check_part(self, part)
        for ok, key, msg in [  # the checks that span parts
            (self.warmstart_max_length > self.max_context_tokens, "warmstart_max_length",
             "warmstart_max_length must be larger than max_context_tokens (room for the turn)"),
            (self.gate_level == "turn" or self.conv_contexts >= 20, "gate_level",
             "gate_level conversation needs conv_contexts >= 20 (the conversations it reads)"),
            (self.gate_level == "turn" or self.conv_readings == "every", "conv_readings",
             "gate_level conversation reads the conversations at every reading: set conv_readings every"),
        ]:
            if not ok:
                raise ConfigError(f"{msg}; fix it in the YAML config or with --{key} on the command line")

    def part(self, name: str):
        """One part of this config as its own typed object (a copy): `cfg.part("sampling").sim_top_p`."""
        import dataclasses

        cls = PARTS[name]
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})


def resolved(cfg: AdversaryConfig) -> dict:
    """The resolved config grouped by part ({"model": {...}, "data": {...}, ...}: what every run, checkpoint and
    export saves); a config that is not an AdversaryConfig is saved flat."""
    import dataclasses

    from conversations.config import to_jsonable

    flat = to_jsonable(cfg)
    if not isinstance(cfg, AdversaryConfig):
        return flat
    return {name: {f.name: flat[f.name] for f in dataclasses.fields(part)} for name, part in PARTS.items()}


def flat_resolved(doc: dict) -> dict:
    """The flat keys of a saved config, grouped by part (`resolved`) or flat (runs from before the parts)."""
    if doc and all(isinstance(v, dict) for v in doc.values()) and set(doc) <= set(PARTS):
        return {k: v for part in doc.values() for k, v in part.items()}
    return dict(doc or {})


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
    cfg.dtype = run_precision(cfg.dtype, args, *given_keys(argv))
    apply_precision(args, cfg.dtype)
    return (cfg, args, *extra)
