"""Multi-turn GRPO for the agent against a user simulator, on TRL's `rollout_func` + `env_mask`, with LoRA.

    accelerate launch agent_rl/train.py --simulator frozen:DIR [--gyms travel,function] [--config configs/agent.yaml]

Each GRPO step: the dataset yields (gym, task) rows, TRL repeats each `num_generations` times; `AgentRollout` plays all
of them in lock step (agent batch -> tags parsed -> one simulator batch -> finished episodes drop out) and returns, per
episode, the first prompt's ids, everything after it as the "completion" (agent turns and user turns interleaved) with
`env_mask` 0 on the user's tokens (never trained on), the trajectory score (the GRPO reward, normalised within each
group by TRL) and per-token turn credits, which `MultiTurnGRPOTrainer` multiplies into the advantages ((B,) -> (B, T)).
Per-gym episode returns and agent turns are logged as `agent/return/<gym>` and `agent/turns/<gym>`.

Config: `AgentRLArgs` below plus every `trl.GRPOConfig` field, from `--config FILE.yaml` and `--key value` overrides.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file (accelerate launch agent_rl/train.py): import the package, not siblings
    _root = str(Path(__file__).resolve().parents[1])
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    sys.path.insert(0, _root)

import json  # noqa: E402
import logging  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

from conversations.assets import before_another_trainer  # noqa: E402
from conversations.cli_util import friendly_errors  # noqa: E402
from conversations.config import ConfigError, dump_config, parse_config  # noqa: E402
from conversations.seeds import derive_seed, seed_for  # noqa: E402

from agent_rl.credit import TRAJECTORY_SCORES, TURN_CREDITS, trajectory_score, turn_credits  # noqa: E402
from agent_rl.agents import ROLLOUT_TEMPERATURE, ROLLOUT_TOP_P  # noqa: E402
from generator.engine.resume import KV_CACHE_MB  # noqa: E402
from agent_rl.users import UserSamplingArgs  # noqa: E402
from generator.model import LoraArgs  # noqa: E402

log = logging.getLogger("agent_rl.train")


@dataclass
class AgentRLArgs(UserSamplingArgs, LoraArgs):
    """What is specific to agent RL; the optimiser, batch and GRPO settings are GRPOConfig's."""

    agent_model: str = field(default="smollm2-135m-instruct", metadata={"help": "agent base: asset name, id or path"})
    simulator: str = field(
        default="scripted:oracle",
        metadata={"help": "the user simulator: frozen:DIR, hf:MODEL, openai:MODEL@URL, scripted:oracle|terse"},
    )
    gyms: str = field(default="all", metadata={"help": "comma-separated gyms to train on, or 'all'"})
    tasks_per_gym: int = field(default=0, metadata={"help": "use the first N train tasks of each gym (0: all)"})
    max_turns: int = field(default=0, metadata={"help": "turn limit for every gym (0: each gym's own)"})
    turn_credit: str = field(default="equal", metadata={"help": "equal | r2g (see agent_rl/credit.py)"})
    trajectory_score: str = field(default="sum", metadata={"help": "sum | r2g: the score GRPO normalises per group"})
    gamma: float = field(default=0.8, metadata={"help": "discount for r2g credits and scores"})
    format_bonus: float = field(
        default=0.0,
        metadata={"help": "added to the trajectory score x the fraction of well-formed (tagged) agent turns; a "
                          "training-only shaping term for agents that have not been taught the protocol (0: off)"},
    )
    agent_max_new_tokens: int = field(default=48, metadata={"help": "token limit of one agent turn"})
    agent_temperature: float = field(default=ROLLOUT_TEMPERATURE, metadata={
        "help": "agent sampling temperature during rollouts, and of the loss's log-probabilities (TRL's "
                "`temperature` is set to it; 1: the policy as it is; agent_rl.agents says why)"})
    agent_top_p: float = field(default=ROLLOUT_TOP_P, metadata={"help": "agent nucleus mass during rollouts (1: off)"})
    max_seq_len: int = field(default=2048, metadata={"help": "an episode's token limit (prompt + all turns)"})
    torch_threads: int = field(default=0, metadata={"help": "torch intra-op threads (0: conversations.threads chooses)"})
    rollout_merge: bool = field(default=True, metadata={
        "help": "decode the rollouts on a merged copy of the LoRA policy in the run's precision (the engine's path "
                "everywhere else); false decodes the unmerged training model (no extra copy of the weights: for a "
                "GPU short of memory)"})
    loss_by_length: bool = field(default=True, metadata={
        "help": "the loss's micro-batches group episodes of like length, each cut to the columns it uses (the same "
                "gradient; agent_rl.micro_batches); false: TRL's shuffled micro-batches at the step's full width"})
    loss_share_prefix: bool = field(default=True, metadata={
        "help": "the loss's micro-batches group the episodes of one prompt, and their common prefix (system prompt, "
                "rules, first observation) runs once per micro-batch (the same gradient; agent_rl.micro_batches); "
                "takes the place of loss_by_length's grouping"})
    kv_cache_mb: float = field(default=KV_CACHE_MB, metadata={
        "help": "memory (MiB) for the episodes' keys and values between the agent's turns, so a turn prefills only "
                "what came after the last one (0: every turn prefills its whole episode)"})
    dtype: str = field(default="auto", metadata={
        "help": "precision: auto (bf16 on GPUs and fast-bf16 CPUs, else fp32), bf16 or fp32; --bf16 means the same"})
    eval_every: int = field(default=0, metadata={
        "help": "the learning curve: every N steps (and before the first, after the last) the policy plays the test "
                "tasks of eval_gyms against each of eval_simulators, as agent_rl.evaluate samples (agent_rl.curve); "
                "written to OUTPUT_DIR/curve.jsonl (0: no curve)"})
    eval_simulators: str = field(default="scripted:oracle,scripted:terse", metadata={
        "help": "comma-separated simulators the curve is read against (fixed for the run)"})
    eval_gyms: str = field(default="all", metadata={"help": "the curve's gyms (their test tasks), or 'all'"})
    eval_tasks_per_gym: int = field(default=0, metadata={"help": "the curve's first N test tasks of each gym (0: all)"})
    eval_repeats: int = field(default=1, metadata={
        "help": "the curve's episodes per task (seeds 0..N-1): more power per reading at N times its cost"})

    def __post_init__(self):
        from agent_rl.gyms import resolve_gyms
        from conversations.precision import normalise_dtype

        from agent_rl.users import check_simulator_spec
        from conversations.assets import check_model_name
        from conversations.config import check_ranges

        self.dtype = normalise_dtype(self.dtype)
        check_ranges(self, {"tasks_per_gym": ">= 0", "max_turns": ">= 0", "gamma": "(0, 1]", "format_bonus": ">= 0",
                            "agent_max_new_tokens": ">= 1", "agent_temperature": "> 0", "agent_top_p": "(0, 1]",
                            "max_seq_len": ">= 64", "user_max_new_tokens": ">= 1", "user_temperature": ">= 0",
                            "user_top_p": "(0, 1]", "user_batch_size": ">= 1", "lora_r": ">= 1", "lora_alpha": "> 0",
                            "lora_dropout": "[0, 1)", "torch_threads": ">= 0", "eval_every": ">= 0", "kv_cache_mb": ">= 0",
                            "eval_tasks_per_gym": ">= 0", "eval_repeats": ">= 1"})
        check_model_name(self.agent_model, "agent_model")
        check_simulator_spec(self.simulator)
        for spec in self.eval_simulators.split(","):
            check_simulator_spec(spec)
        self.eval_gym_list = resolve_gyms(self.eval_gyms)
        if self.turn_credit not in TURN_CREDITS:
            raise ConfigError(f"turn_credit must be one of {TURN_CREDITS}, got '{self.turn_credit}'")
        if self.trajectory_score not in TRAJECTORY_SCORES:
            raise ConfigError(f"trajectory_score must be one of {TRAJECTORY_SCORES}, got '{self.trajectory_score}'")
        self.gym_list = resolve_gyms(self.gyms)


def build_dataset(args: AgentRLArgs):
    """One row per (gym, train task): the agent's first messages (what TRL logs as the prompt; the rollout rebuilds
    the episode from the task) plus the keys that find the task again."""
    from datasets import Dataset

    from agent_rl.gyms import GymEnv, get_gym

    rows = []
    for g in args.gym_list:
        for t in get_gym(g).tasks("train")[: args.tasks_per_gym or None]:
            env = GymEnv(g)
            env.reset(task=t)
            rows.append({"prompt": env.messages, "gym": g, "task_id": t.id})
    return Dataset.from_list(rows)


class AgentRollout:
    """TRL `rollout_func`: plays one episode per (repeated) prompt in lock step and returns token ids, `env_mask`,
    per-token turn credits and the trajectory score for each."""

    def __init__(self, args: AgentRLArgs, simulator, tokenizer):
        self.args, self.simulator, self.tokenizer = args, simulator, tokenizer
        self.last_results: list = []  # the latest step's episodes and output, for tests and debugging
        self.last_output: dict = {}

    def __call__(self, prompts: list, trainer) -> dict[str, Any]:
        from agent_rl.agents import PolicyAgent
        from agent_rl.gyms import get_gym
        from agent_rl.rollout import EpisodeSpec, run_episodes

        a = self.args
        inputs = trainer._rollout_inputs  # the rows behind `prompts`, same order (set by MultiTurnGRPOTrainer)
        if inputs is None or len(inputs) != len(prompts):
            raise RuntimeError("AgentRollout must run under MultiTurnGRPOTrainer (it needs each prompt's task)")
        step, rank = trainer.state.global_step, trainer.accelerator.process_index
        specs = [
            EpisodeSpec(x["gym"], get_gym(x["gym"]).get_task(x["task_id"]), seed_for("agent_episode", step, i),
                        a.max_turns or None)
            for i, x in enumerate(inputs)
        ]
        import time

        from generator.engine import policy_engine

        t0 = time.perf_counter()
        # the engine's path, as for every other caller: a merged bf16 copy of the LoRA policy where the CPU is fast in
        # bf16 (the unmerged LoRA model decoded 38-49 s a GRPO step of 8 episodes); the training weights untouched
        with policy_engine(trainer, self.tokenizer, precision=a.dtype, batch_size=max(1, len(specs)),
                           merge_lora=a.rollout_merge, gather_zero3=trainer.args.ds3_gather_for_generation) as engine:
            agent = PolicyAgent(
                engine.model,
                self.tokenizer,
                max_new_tokens=a.agent_max_new_tokens,
                temperature=a.agent_temperature,
                top_p=a.agent_top_p,
                max_seq_len=a.max_seq_len,
                # differs per step and per process: the same task must not replay the same random stream
                seed=derive_seed(trainer.args.seed, step=step, rank=rank),
                record=True,
                engine=engine,
                kv_cache_mb=a.kv_cache_mb,
            )
            results = run_episodes(agent, self.simulator, specs)
        seconds = time.perf_counter() - t0  # the merged copy, the agent's and the user's turns: the step's rollout part
        self.last_results = results
        out: dict[str, list] = {k: [] for k in ("prompt_ids", "completion_ids", "env_mask", "turn_credit",
                                                "trajectory_score", "episode_return", "episode_turns", "format_ok")}
        for r in results:
            rec = r.tokens  # what the policy saw and sampled, token for token (PolicyAgent(record=True))
            credits = turn_credits(r.turn_rewards, a.turn_credit, a.gamma)  # one weight per agent turn
            out["prompt_ids"].append(rec.ids[: rec.prompt_len])
            out["completion_ids"].append(rec.completion_ids)
            out["env_mask"].append(rec.mask)  # 1: the agent sampled it; 0: the user's turn (and template glue)
            out["turn_credit"].append([credits[t] if t >= 0 else 0.0 for t in rec.turn_of])
            format_ok = 1.0 - r.format_errors / max(1, r.turns)  # share of tagged agent turns
            score = trajectory_score(r.turn_rewards, a.trajectory_score, a.gamma) + a.format_bonus * format_ok
            out["trajectory_score"].append(score)
            out["episode_return"].append(r.total)
            out["episode_turns"].append(r.turns)
            out["format_ok"].append(format_ok)
        out["rollout_seconds"] = [seconds] * len(results)
        out["logprobs"] = None  # TRL recomputes log-probs itself; sampling ones matter only for vLLM correction
        self.last_output = out
        return out


def trajectory_reward(completions, trajectory_score, episode_return, gym, episode_turns, format_ok, log_metric=None,
                      rollout_seconds=None, **_):
    """The GRPO reward: each episode's trajectory score (computed in the rollout). Logs per-gym returns (the task
    reward alone, without any format bonus), turns (overall and per gym), the share of tagged turns and the
    rollout's seconds."""
    if log_metric is not None:
        if rollout_seconds:
            log_metric("agent/rollout_seconds", float(rollout_seconds[0]))
        for g, ret in zip(gym, episode_return):
            log_metric(f"agent/return/{g}", float(ret))
        for g, n, ok in zip(gym, episode_turns, format_ok):
            log_metric("agent/turns", float(n))
            # per gym too: an agent that learns to answer early shows here before its return falls (docs/scaling.md)
            log_metric(f"agent/turns/{g}", float(n))
            log_metric("agent/format_ok", float(ok))
    return [float(s) for s in trajectory_score]


def _trainer_class():
    import torch
    from trl import GRPOTrainer
    from trl.trainer.utils import pad

    from agent_rl.micro_batches import by_length, by_prefix, padded_tokens, shared_prefix_logps

    class MultiTurnGRPOTrainer(GRPOTrainer):
        """GRPOTrainer whose rollout function sees each prompt's row, whose advantages carry turn credits, and whose
        loss runs over micro-batches of like-length episodes (`loss_by_length`) or of one prompt's episodes, their
        common prefix run once (`loss_share_prefix`)."""

        _rollout_inputs = None
        loss_by_length = True
        loss_share_prefix = False

        def _prepare_inputs(self, generation_batch):
            every = self.args.steps_per_generation * self.num_iterations
            fresh = self.model.training and (self._step % every == 0 or self._buffered_inputs is None)
            inputs = super()._prepare_inputs(generation_batch)
            if not fresh:
                return inputs
            ran, real = padded_tokens(self._buffered_inputs)
            if self.loss_share_prefix or self.loss_by_length:
                self._buffered_inputs = (by_prefix if self.loss_share_prefix else by_length)(self._buffered_inputs)
                inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]
                ran = padded_tokens(self._buffered_inputs)[0]
            self._metrics["train"]["agent/loss_tokens"].append(float(ran))  # what the loss's forward runs over
            self._metrics["train"]["agent/loss_padding"].append(1.0 - real / max(ran, 1))
            return inputs

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                               batch_size=None, compute_entropy=False, compute_aux_loss=False, **extra):
            plain = not compute_aux_loss and all(v is None for v in extra.values())
            if self.loss_share_prefix and plain and (batch_size is None or batch_size >= len(input_ids)):
                with self.accelerator.autocast():
                    out = shared_prefix_logps(model, input_ids, attention_mask, logits_to_keep, compute_entropy)
                if out is not None:
                    self._metrics["train" if model.training else "eval"]["agent/loss_shared_tokens"].append(
                        float(out[2]))
                    return out[0], out[1], None
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **extra)

        def _generate_and_score_completions(self, inputs):
            self._rollout_inputs = inputs
            try:
                out = super()._generate_and_score_completions(inputs)
            finally:
                self._rollout_inputs = None
            # the rollout's extra fields were merged into `inputs`; credits are 0 on user tokens (masked anyway)
            credit = pad(
                [torch.tensor(x["turn_credit"], dtype=torch.float32) for x in inputs],
                padding_value=0.0,
                padding_side="right",
                pad_to_multiple_of=self.pad_to_multiple_of,
            ).to(out["advantages"].device)  # (B, T)
            width = out["completion_ids"].shape[1]
            if credit.shape[1] < width:
                credit = torch.nn.functional.pad(credit, (0, width - credit.shape[1]))
            out["advantages"] = out["advantages"].unsqueeze(1) * credit[:, :width]  # (B,) -> (B, T)
            return out

    return MultiTurnGRPOTrainer


def _step_seconds_callback():
    """`agent/step_seconds` in every log: the wall time of the last GRPO step, its rollouts included."""
    import time

    from transformers import TrainerCallback

    class StepSeconds(TrainerCallback):
        t0, last = None, None

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.last = time.perf_counter() - self.t0

        def on_log(self, args, state, control, logs=None, **kw):
            # the trainer has already appended a copy of `logs` to the history: the figure goes into both
            if self.last is not None:
                for d in (logs, state.log_history[-1] if state.log_history else None):
                    if d is not None:
                        d["agent/step_seconds"] = round(self.last, 2)

    return StepSeconds()


def _adapter_base_callback(base: str):
    """Each saved checkpoint's adapter points at the agent it was trained on when that is itself an adapter (protocol
    SFT's), so `--agent runs/x/checkpoint-N` loads both (generator.model.record_adapter_base)."""
    from transformers import TrainerCallback

    from generator.model import record_adapter_base

    class AdapterBase(TrainerCallback):
        def on_save(self, args, state, control, **kw):
            if state.is_world_process_zero:
                record_adapter_base(Path(args.output_dir) / f"checkpoint-{state.global_step}", base)

    return AdapterBase()


def train(args: AgentRLArgs, grpo, callbacks: list | None = None):
    """Run agent RL. Returns (summary, trainer); the summary is also written to OUTPUT_DIR/agent_rl.json and the
    LoRA adapter (plus tokenizer) to OUTPUT_DIR, loadable as an agent: `--agent OUTPUT_DIR`."""
    import torch

    from generator.model import load_generator, pick_device, prepare_training

    from agent_rl.users import load_simulator, user_settings

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if grpo.per_device_train_batch_size * max(1, grpo.gradient_accumulation_steps) % grpo.num_generations:
        raise ConfigError(
            "per_device_train_batch_size x gradient_accumulation_steps must be a multiple of num_generations"
        )
    # the loss's log-probabilities are those of the distribution the rollouts sampled: TRL divides the logits by its
    # own `temperature` (default 1), which would train an agent sampled at 0.7 on its T-1 log-probabilities
    grpo.temperature, grpo.top_p = args.agent_temperature, args.agent_top_p
    simulator = load_simulator(args.simulator, user_settings(args), batch_size=args.user_batch_size, seed=grpo.seed)
    model, tokenizer = load_generator(args.agent_model)
    prepare_training(model, pick_device(), args.max_seq_len)
    dataset = build_dataset(args)
    rollout = AgentRollout(args, simulator, tokenizer)
    curve = None
    if args.eval_every:
        from agent_rl.curve import curve_callback

        curve = curve_callback(args, tokenizer, grpo.output_dir)
        callbacks = [*(callbacks or []), curve]
    lora = args.peft_config()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    before_another_trainer()
    trainer = _trainer_class()(
        model=model,
        reward_funcs=[trajectory_reward],
        args=grpo,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        rollout_func=rollout,
        callbacks=[_step_seconds_callback(), _adapter_base_callback(args.agent_model), *(callbacks or [])],
    )
    trainer.loss_by_length, trainer.loss_share_prefix = args.loss_by_length, args.loss_share_prefix
    resume = grpo.resume_from_checkpoint
    trainer.train(resume_from_checkpoint=True if str(resume).lower() in ("true", "last") else resume)
    trainer.save_model(grpo.output_dir)
    if trainer.accelerator.is_main_process:
        from generator.model import record_adapter_base

        record_adapter_base(grpo.output_dir, args.agent_model)  # else loading it would drop protocol SFT's adapter
    history = [h for h in trainer.state.log_history if "loss" in h]
    summary = {
        "output_dir": grpo.output_dir,
        "agent_model": args.agent_model,
        "simulator": args.simulator,
        "simulator_manifest": {
            k: v for k, v in (getattr(simulator, "manifest", None) or {}).items()
            if k in ("base_model", "warm_start", "data_fingerprint", "best", "prompt_format_version", "created")
        },
        "gyms": args.gym_list,
        "steps": trainer.state.global_step,
        "log_history": history,
        "curve": curve.readings if curve else [],  # agent_rl.curve: held-out readings (a resumed run's included)
    }
    if trainer.accelerator.is_main_process:
        Path(grpo.output_dir).mkdir(parents=True, exist_ok=True)
        dump_config({"agent_rl": args, "grpo": grpo}, Path(grpo.output_dir) / "agent_rl_config.json")
        (Path(grpo.output_dir) / "agent_rl.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary, trainer


@friendly_errors
def main(argv: list[str] | None = None) -> int:
    from trl import GRPOConfig

    from generator.model import check_vllm

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from conversations.config import given_keys
    from conversations.precision import apply_precision, run_precision

    args, grpo = parse_config((AgentRLArgs, GRPOConfig), argv, prog="agent_rl/train.py")
    from conversations.cli_util import start_process

    start_process()
    args.dtype = run_precision(args.dtype, grpo, *given_keys(argv))
    apply_precision(grpo, args.dtype)
    check_vllm(grpo.use_vllm)
    summary, _ = train(args, grpo)
    last = summary["log_history"][-1] if summary["log_history"] else {}
    print(json.dumps({"output_dir": summary["output_dir"], "steps": summary["steps"], "last": last}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
