"""Teach an agent the protocol before GRPO: SFT on the scripted oracle agent's trajectories.

    accelerate launch agent_rl/sft.py --agent_model smollm2-135m-instruct --gyms travel,function,persuade \\
        --output_dir runs/agent-sft [--max_steps 60]

An untrained 135M agent used the tag protocol on 1 turn in 60: GRPO has nothing to reinforce. The gyms make the
demonstrations: the scripted oracle agent (`agent_rl.agents.ScriptedAgent("oracle")`) plays every train task of
the gyms against the scripted oracle user, and each of its turns becomes a prompt-completion example, the prompt
being the agent's chat so far (system prompt with the protocol and the gym's rules, the observations, its earlier
turns) and the completion the oracle's tagged turn. TRL's SFTTrainer trains a LoRA adapter on them (loss on the
completion only); OUTPUT_DIR holds the adapter, loadable as `--agent_model OUTPUT_DIR` by `agent_rl/train.py` and
as an agent spec by `agent_rl.evaluate`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conversations.cli_util import friendly_errors  # noqa: E402
from conversations.config import ConfigError, parse_config  # noqa: E402
from generator.model import LoraArgs  # noqa: E402


@dataclass
class AgentSFTArgs(LoraArgs):
    agent_model: str = field(default="smollm2-135m-instruct", metadata={"help": "agent base: asset name, id or path"})
    gyms: str = field(default="all", metadata={"help": "comma-separated gyms whose train tasks make the examples"})
    max_turns: int = field(default=0, metadata={"help": "turn limit for every gym (0: each gym's own)"})
    dtype: str = field(default="auto", metadata={"help": "precision: auto, bf16 or fp32"})
    curve_every: int = field(default=0, metadata={
        "help": "every N steps, the loss and token accuracy on the oracle's turns of the test tasks (never trained "
                "on), written as the curve in agent_sft.json (0: no curve)"})

    def __post_init__(self):
        from agent_rl.gyms import resolve_gyms
        from conversations.assets import check_model_name
        from conversations.config import check_ranges
        from conversations.precision import normalise_dtype

        check_ranges(self, {"max_turns": ">= 0", "lora_r": ">= 1", "lora_alpha": "> 0", "lora_dropout": "[0, 1)",
                            "curve_every": ">= 0"})
        check_model_name(self.agent_model, "agent_model")
        self.dtype = normalise_dtype(self.dtype)
        self.gym_list = resolve_gyms(self.gyms)


def oracle_examples(gyms: list[str], max_turns: int | None = None, split: str = "train") -> list[dict]:
    """One {prompt, completion} example per oracle agent turn on every task of `split` of `gyms`."""
    from agent_rl.agents import EpisodeView, ScriptedAgent
    from agent_rl.gyms import GymEnv, get_gym
    from agent_rl.users import ScriptedUser

    agent, user, rows = ScriptedAgent("oracle"), ScriptedUser("oracle"), []
    for g in gyms:
        for task in get_gym(g).tasks(split):
            env = GymEnv(g, user, split=split, max_turns=max_turns)
            env.reset(task=task)
            while not env.done:
                view = EpisodeView(uid=0, gym=g, task=task, turn=env.turn, seed=0, messages=env.messages)
                text = agent.act([view])[0]
                rows.append({"prompt": [dict(m) for m in env.messages],
                             "completion": [{"role": "assistant", "content": text}], "gym": g})
                env.step(text)
    return rows


def train(args: AgentSFTArgs, sft, rows: list[dict] | None = None) -> dict:
    """SFT of `args.agent_model` on `rows` ({prompt, completion, gym}; default: the oracle's turns on the train
    tasks). An adapter folder as `agent_model` is merged first and the new adapter recorded on top of it."""
    from datasets import Dataset
    from trl import SFTTrainer

    from conversations.assets import before_another_trainer

    from generator.model import load_generator, pick_device, prepare_training, record_adapter_base

    rows = oracle_examples(args.gym_list, args.max_turns or None) if rows is None else rows
    if not rows:
        raise ConfigError("no oracle turns: the gyms have no train tasks")
    model, tok = load_generator(args.agent_model)
    prepare_training(model, pick_device(), sft.max_length)
    data = Dataset.from_list([{"prompt": r["prompt"], "completion": r["completion"]} for r in rows])
    held = None
    if args.curve_every:  # the curve: the oracle's turns on tasks the agent never trains on
        held = Dataset.from_list([{"prompt": r["prompt"], "completion": r["completion"]}
                                  for r in oracle_examples(args.gym_list, args.max_turns or None, split="test")])
        sft.eval_strategy, sft.eval_steps = "steps", args.curve_every
    before_another_trainer()
    trainer = SFTTrainer(model=model, args=sft, train_dataset=data, eval_dataset=held, processing_class=tok,
                         peft_config=args.peft_config())
    before = [{"step": 0, **trainer.evaluate()}] if held is not None else []  # the curve's step 0: no update yet
    result = trainer.train()
    trainer.save_model(sft.output_dir)
    if trainer.accelerator.is_main_process:
        record_adapter_base(sft.output_dir, args.agent_model)  # else loading it would drop the lower adapter
    summary = {"output_dir": sft.output_dir, "examples": len(rows), "by_gym": {g: sum(r["gym"] == g for r in rows)
               for g in args.gym_list}, "steps": int(result.global_step), "train_loss": float(result.training_loss),
               "train_runtime_s": round(float(result.metrics.get("train_runtime", 0.0)), 1),
               "curve": [{"step": int(h.get("step", 0)), "eval_loss": h["eval_loss"],
                          "eval_token_accuracy": h.get("eval_mean_token_accuracy")}
                         for h in before + trainer.state.log_history if "eval_loss" in h]}
    if trainer.accelerator.is_main_process:
        (Path(sft.output_dir) / "agent_sft.json").write_text(json.dumps(summary, indent=2))
    return summary


@friendly_errors
def main(argv=None) -> int:
    from trl import SFTConfig

    from conversations.config import given_keys
    from conversations.precision import apply_precision, run_precision

    from generator.sft import SFT_CONFIG_DEFAULTS

    argv = list(sys.argv[1:] if argv is None else argv)
    defaults = {**SFT_CONFIG_DEFAULTS, "max_length": 2048, "per_device_train_batch_size": 4,
                "gradient_accumulation_steps": 2, "logging_steps": 10, "max_steps": 60, "lr_scheduler_type": "constant",
                "output_dir": "runs/agent-sft"}
    args, sft = parse_config((AgentSFTArgs, SFTConfig), argv, prog="agent_rl/sft.py", defaults=defaults)
    from conversations.cli_util import start_process

    start_process()
    args.dtype = run_precision(args.dtype, sft, *given_keys(argv))
    apply_precision(sft, args.dtype)
    print(json.dumps(train(args, sft)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
