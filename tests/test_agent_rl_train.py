"""Multi-turn GRPO on TRL: token bookkeeping of the LM agent (env_mask), and a smoke training run with tiny models."""

import json
import math
from pathlib import Path

import pytest
import torch

from agent_rl.agents import PolicyAgent, load_agent
from agent_rl.gyms import Gym, register_gym, unregister_gym
from agent_rl.rollout import episode_specs, run_episodes
from agent_rl.users import ScriptedUser
from conversations.config import ConfigError, parse_config

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")


class EchoGym(Gym):
    """A test gym whose reward varies with whatever a random model writes (its length), so GRPO groups have spread."""

    name = "echo_test"
    max_turns = 2
    instructions = "Say anything."

    def build_tasks(self, rng):
        return [(f"Hello number {i}.", {"i": i}) for i in range(4)]

    def user_goal(self, task):
        return "Be brief."

    def scripted_user(self, task, context, mode):
        return "Okay, go on."

    def score_reply(self, task, state, question, reply):
        return (len(question) % 7) / 6, False, {}

    def score_answer(self, task, state, answer):
        return 0.0, {}

    def max_return(self, task):
        return 2.0

    def oracle_turn(self, task, turn):
        return "[action] hello"

    def random_turn(self, task, rng, turn):
        return "[action] hi"


@pytest.fixture
def echo_gym():
    register_gym(EchoGym)
    yield "echo_test"
    unregister_gym("echo_test")


def test_policy_agent_sequence_is_what_the_model_saw(tiny_lm_path):
    from generator.model import load_generator

    model, tok = load_generator(tiny_lm_path)
    agent = PolicyAgent(model, tok, max_new_tokens=6, record=True, seed=1)
    specs = episode_specs(["intention", "telepathy"], "train", 1, max_turns=3)
    results = run_episodes(agent, ScriptedUser("oracle"), specs)
    assert not agent.seqs  # every finished episode's tokens left the agent with its result
    for r in results:
        rec = r.tokens
        assert len(rec.ids) == rec.prompt_len + len(rec.mask) == rec.prompt_len + len(rec.turn_of)
        first = tok.apply_chat_template(r.messages[:2], add_generation_prompt=True, return_dict=True)["input_ids"]
        assert rec.ids[: rec.prompt_len] == first
        # split the completion into runs of agent (mask 1) and observation (mask 0) tokens
        runs, cur = [], None
        for tid, m in zip(rec.completion_ids, rec.mask):
            if cur is None or cur[0] != m:
                cur = [m, []]
                runs.append(cur)
            cur[1].append(tid)
        agent_runs = [ids for m, ids in runs if m == 1]
        obs_runs = [ids for m, ids in runs if m == 0]
        assert len(agent_runs) == r.turns and len(obs_runs) == r.turns - 1
        agent_turns = [m["content"] for m in r.messages if m["role"] == "assistant"]
        observations = [m["content"] for m in r.messages[3::2]][: r.turns - 1]
        for ids, text in zip(agent_runs, agent_turns):
            assert tok.decode(ids, skip_special_tokens=True).strip() == text
        for ids, obs in zip(obs_runs, observations):
            # the user's turn in the chat template's glue, never trained on
            assert tok.decode(ids).endswith(f"<|im_start|>user\n{obs}<|im_end|>\n<|im_start|>assistant\n")
        assert {t for t, m in zip(rec.turn_of, rec.mask) if m == 0} == {-1}
        assert sorted({t for t in rec.turn_of if t >= 0}) == list(range(r.turns))


def test_policy_agent_resumes_each_episode_from_its_last_turn(varied_lm):
    """With the keys and values kept between turns, every turn after the first resumes from the episode's cache
    (the engine is handed a covering state for each live episode), and the episodes are token for token the ones
    an agent that prefills everything again samples (greedy, a random model whose tokens depend on the prompt).
    A budget too small for one episode keeps nothing; finished episodes leave no cache behind."""
    model, tok = varied_lm
    specs = episode_specs(["intention", "telepathy"], "train", 2, max_turns=3)

    def play(kv_cache_mb):
        agent = PolicyAgent(model, tok, max_new_tokens=5, temperature=0, record=True, kv_cache_mb=kv_cache_mb)
        complete, resumed = agent.engine.complete, []

        def spy(prompts, settings, seed=0, states=None, **kw):
            resumed.append((sum(st is not None and st.covers(p) for st, p in zip(states or [], prompts)), len(prompts)))
            return complete(prompts, settings, seed, states=states, **kw)

        agent.engine.complete = spy
        results = run_episodes(agent, ScriptedUser("oracle"), specs)
        assert not agent.kv
        return [r.tokens.ids for r in results], resumed, agent.kv

    kept, resumed, big = play(1024)
    fresh, none, _ = play(0)
    tight, _, store = play(1e-6)
    # the counters: with the tiny budget every cache handed back is dropped and nothing is held
    assert store.dropped == sum(n for _, n in resumed) and store.peak_bytes == 0
    assert big.dropped == 0 and big.peak_bytes > 0 and big.used == 0 and not len(big)
    assert kept == fresh == tight
    # every episode starts at once: the first call has nothing to resume, each later one resumes all it holds
    assert resumed[0] == (0, len(specs)) and len(resumed) > 1
    assert all(k == n for k, n in resumed[1:])
    assert {k for k, _ in none} == {0}


def test_configs_parse():
    from trl import GRPOConfig

    from agent_rl.train import AgentRLArgs

    for name in ("agent_smoke.yaml", "agent.yaml"):
        args, grpo = parse_config((AgentRLArgs, GRPOConfig), ["--config", str(ROOT / "configs" / name)])
        assert args.gym_list and grpo.num_generations >= 2
    with pytest.raises(ConfigError, match="turn_credit"):
        parse_config((AgentRLArgs, GRPOConfig), ["--turn_credit", "bogus", "--bf16", "false"])


def test_smoke_training_updates_the_adapter(echo_gym, tmp_path, capsys):
    from transformers import TrainerCallback
    from trl import GRPOConfig

    from agent_rl.train import AgentRLArgs, train

    args, grpo = parse_config(
        (AgentRLArgs, GRPOConfig),
        ["--config", str(ROOT / "configs" / "agent_smoke.yaml"), "--gyms", echo_gym, "--output_dir",
         str(tmp_path / "run"), "--torch_threads", "1", "--eval_every", "1", "--eval_simulators", "scripted:oracle",
         "--eval_gyms", echo_gym, "--agent_temperature", "0.9"],
    )
    assert args.turn_credit == "r2g" and args.simulator == "scripted:oracle" and grpo.temperature == 1.0

    class Snapshot(TrainerCallback):
        def on_train_begin(self, args_, state, control, model=None, **kw):
            self.before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    snap = Snapshot()
    summary, trainer = train(args, grpo, callbacks=[snap])
    assert summary["steps"] == 2
    assert trainer.temperature == 0.9  # the loss reads the log-probabilities of the temperature the rollouts sampled
    logs = summary["log_history"]
    assert len(logs) == 2
    for h in logs:
        assert math.isfinite(h["loss"]) and math.isfinite(h["reward"]) and math.isfinite(h["grad_norm"])
        assert math.isfinite(h["agent/return/echo_test"]) and 0 <= h["agent/format_ok"] <= 1
        assert h["agent/turns/echo_test"] == h["agent/turns"] >= 1  # one gym: its turns are all the turns
        assert h["agent/step_seconds"] > 0  # the step's wall time, rollouts included
        assert h["agent/loss_shared_tokens"] > 0  # one task's episodes in a micro-batch: their system prompt ran once
    assert any(h["reward_std"] > 0 for h in logs)
    # every LoRA parameter moved (B starts at zero and moves at step 1; A gets a gradient from step 2)
    after = dict(trainer.model.named_parameters())
    assert snap.before and all("lora" in n for n in snap.before)
    unchanged = [n for n, p in snap.before.items() if torch.equal(p, after[n].detach())]
    assert not unchanged, unchanged
    # the user's tokens are masked out: env_mask 0 on them, and no turn credit there
    out = trainer.rollout_func.last_output
    for mask, credit in zip(out["env_mask"], out["turn_credit"]):
        assert 0 in mask and 1 in mask
        assert all(c == 0.0 for c, m in zip(credit, mask) if m == 0)
        assert all(c >= 0.0 for c in credit) and any(c > 0.0 for c, m in zip(credit, mask) if m == 1)
    # advantages become per-token (B, T): zero on the simulator's tokens
    batch = [dict(trainer.train_dataset[0]) for _ in range(grpo.num_generations)]
    scored = trainer._generate_and_score_completions(batch)
    adv, tool_mask = scored["advantages"], scored["tool_mask"]
    assert adv.shape == scored["completion_ids"].shape and torch.isfinite(adv).all()
    assert (adv[(tool_mask == 0)] == 0).all()
    # the saved adapter is an agent
    saved = Path(grpo.output_dir)
    assert (saved / "adapter_config.json").exists() and (saved / "agent_rl.json").exists()
    agent = load_agent(str(saved), max_new_tokens=4)
    assert len(run_episodes(agent, ScriptedUser("oracle"), episode_specs([echo_gym], "test", max_turns=1))) == 1
    # the learning curve: a reading before the first step and after each, on every test task, paired to the first
    curve = summary["curve"]
    specs = episode_specs([echo_gym], "test", max_turns=args.max_turns)
    assert [r["step"] for r in curve] == [0, 1, 2]
    for r in curve:
        row = r["simulators"]["scripted:oracle"]
        assert row["episodes"] == row["tasks"] == len(specs) and len(row["returns"][echo_gym]) == len(specs)
        assert row["score"] == pytest.approx(100 * sum(row["returns"][echo_gym]) / len(specs), abs=0.01)
        assert ("vs_start" in row) == (r["step"] > 0)
    # step 0 reads the agent before training (LoRA B = 0: the base model), sampled as agent_rl.evaluate samples
    from agent_rl.curve import EVAL_MAX_NEW_TOKENS

    base = load_agent(f"hf:{args.agent_model}", max_new_tokens=EVAL_MAX_NEW_TOKENS, max_seq_len=args.max_seq_len,
                      batch_size=len(specs))
    before = [e.total for e in run_episodes(base, ScriptedUser("oracle"), specs)]
    assert curve[0]["simulators"]["scripted:oracle"]["returns"][echo_gym] == pytest.approx(before)
    # the CLI draws the run's curve and prints one table row per reading
    from agent_rl.curve import main as curve_main

    assert curve_main([f"smoke={grpo.output_dir}", "--out", str(tmp_path / "curve.png")]) == 0
    assert (tmp_path / "curve.png").stat().st_size > 0
    table = capsys.readouterr().out
    first = curve[0]["simulators"]["scripted:oracle"]["score"]
    assert table.count("| smoke |") == 3 and f"| smoke | 0 | scripted:oracle | {first:.1f} [" in table


def test_oracle_examples_are_the_oracle_turns_in_the_agents_own_chat():
    from agent_rl.sft import oracle_examples

    rows = oracle_examples(["travel", "function"])
    from agent_rl.gyms import get_gym

    assert {r["gym"] for r in rows} == {"travel", "function"}
    first = rows[0]
    task = get_gym(first["gym"]).tasks("train")[0]
    assert first["prompt"][0]["role"] == "system" and first["prompt"][1] == {"role": "user", "content": task.opening}
    assert first["completion"][0]["content"] == get_gym(first["gym"]).oracle_turn(task, 0)
    assert all(r["completion"][0]["content"].startswith(("[action]", "[answer]")) for r in rows)
    # a later turn's prompt holds the earlier oracle turn and the scripted user's reply to it
    second = next(r for r in rows[1:] if len(r["prompt"]) > 2)
    assert second["prompt"][2]["role"] == "assistant" and second["prompt"][3]["role"] == "user"


def test_agent_sft_cli_trains_an_adapter_the_agent_loader_reads(tmp_path, tiny_lm_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "sft"
    cmd = [sys.executable, str(ROOT / "agent_rl" / "sft.py"), "--agent_model", tiny_lm_path, "--gyms", "function",
           "--max_steps", "2", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
           "--dtype", "fp32", "--output_dir", str(out), "--curve_every", "1", "--per_device_eval_batch_size", "8"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((out / "agent_sft.json").read_text())
    assert summary["steps"] == 2 and summary["examples"] > 10 and (out / "adapter_config.json").exists()
    # the curve on the test tasks' oracle turns: before any update, then every step
    assert [c["step"] for c in summary["curve"]] == [0, 1, 2] and all(c["eval_loss"] > 0 for c in summary["curve"])
    agent = load_agent(str(out))
    assert isinstance(agent, PolicyAgent)


def test_an_adapter_trained_on_an_adapter_loads_both(tiny_lm_path, tmp_path):
    """Agent GRPO after protocol SFT saves an adapter over the SFT-merged model; peft records the plain base under
    it, so without `record_adapter_base` loading the GRPO agent silently drops what SFT taught."""
    from peft import LoraConfig, get_peft_model

    from generator.model import load_generator, record_adapter_base

    ids = torch.tensor([[1, 5, 9, 13, 2]])

    def with_random_adapter(model, seed):
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        g = torch.Generator().manual_seed(seed)
        for n, p in model.named_parameters():
            if "lora_B" in n:  # B starts at 0: an adapter that changes nothing would prove nothing
                p.data = torch.randn(p.shape, generator=g) * 0.5
        return model

    base, tok = load_generator(tiny_lm_path, dtype="fp32")
    with_random_adapter(base, 0).save_pretrained(tmp_path / "sft")
    tok.save_pretrained(tmp_path / "sft")
    sft, _ = load_generator(tmp_path / "sft", dtype="fp32")
    grpo = with_random_adapter(sft, 1)
    with torch.no_grad():
        want = grpo(ids).logits
    grpo.save_pretrained(tmp_path / "grpo")
    dropped, _ = load_generator(tmp_path / "grpo", dtype="fp32")
    with torch.no_grad():
        assert not torch.allclose(dropped(ids).logits, want, atol=1e-3)  # the bug: SFT's adapter gone
    record_adapter_base(tmp_path / "grpo", tmp_path / "sft")
    both, _ = load_generator(tmp_path / "grpo", dtype="fp32")
    with torch.no_grad():
        assert torch.allclose(both(ids).logits, want, atol=1e-4)
    # a plain base is left as peft wrote it
    before = (tmp_path / "sft" / "adapter_config.json").read_text()
    record_adapter_base(tmp_path / "sft", tiny_lm_path)
    assert (tmp_path / "sft" / "adapter_config.json").read_text() == before


def test_curve_reading_pairs_tasks_and_averages_repeats():
    """A reading's figures, exactly: repeats of a task are averaged before the CI and the pairing (tasks, not
    episodes, are the unit), the score is the mean over gyms, and the difference to the first reading is paired."""
    from agent_rl.curve import reading
    from agent_rl.gyms import EpisodeResult

    def ep(gym, task, seed, r, errors=0):
        return EpisodeResult(gym, task, "test", seed, [r], 2, True, False, 1.0, format_errors=errors)

    start = reading({"u": [ep("a", "t1", 0, 0.0), ep("a", "t2", 0, 1.0), ep("b", "t3", 0, 0.5)]}, ["a", "b"], None)
    row = start["u"]
    assert row["returns"] == {"a": [0.0, 1.0], "b": [0.5]} and row["score"] == 50.0 and row["tasks"] == 3
    assert "vs_start" not in row and row["format_ok"] == 1.0
    later = reading({"u": [ep("a", "t1", 0, 1.0), ep("a", "t2", 0, 1.0), ep("b", "t3", 0, 0.5),
                           ep("a", "t1", 1, 0.0), ep("a", "t2", 1, 1.0), ep("b", "t3", 1, 1.5, errors=1)]},
                    ["a", "b"], start)["u"]
    assert later["returns"] == {"a": [0.5, 1.0], "b": [1.0]} and later["episodes"] == 6 and later["tasks"] == 3
    assert later["score"] == 87.5  # (0.75 + 1.0) / 2 x 100
    assert later["vs_start"][0] == 37.5 and later["format_ok"] == round(1 - 1 / 12, 4)


def _episode(task_id: str, total: float, turns: int = 1):
    from agent_rl.gyms import EpisodeResult

    msgs = [{"role": "system", "content": "rules"}, {"role": "user", "content": "open"}]
    for t in range(turns):
        msgs += [{"role": "assistant", "content": f"turn {t}"}, {"role": "user", "content": f"obs {t}"}]
    return EpisodeResult("g", task_id, "train", 0, [total], turns, True, False, 1.0, messages=msgs)


def test_filtered_bc_keeps_each_tasks_best_above_its_worst_and_the_floor():
    from agent_rl.filtered_bc import examples, select

    eps = [_episode("a", 0.5), _episode("a", 0.9, turns=2), _episode("a", 0.9),  # best 0.9 (the first of the tie)
           _episode("b", 0.4), _episode("b", 0.4),  # every sample equal: nothing to learn
           _episode("c", 0.0), _episode("c", -0.2),  # best not above the floor 0
           _episode("d", 0.3), _episode("d", 0.1)]
    kept = select(eps, keep_above=0.0)
    assert [(e.task_id, e.total, e.turns) for e in kept] == [("a", 0.9, 2), ("d", 0.3, 1)]
    rows = examples(kept)
    assert [r["completion"][0]["content"] for r in rows] == ["turn 0", "turn 1", "turn 0"]
    assert [len(r["prompt"]) for r in rows] == [2, 4, 2]  # the chat before each turn, ending with an observation
    assert all(r["prompt"][-1]["role"] == "user" for r in rows)


def test_filtered_bc_round_trains_on_kept_episodes_and_reads_the_curve(echo_gym, tmp_path, capsys):
    from trl import SFTConfig

    from agent_rl.filtered_bc import FilteredBCArgs, run
    from generator.model import load_generator

    args, sft = parse_config((FilteredBCArgs, SFTConfig), [
        "--agent_model", "tiny-random", "--simulator", "scripted:oracle", "--gyms", echo_gym, "--rounds", "1",
        "--eval_gyms", echo_gym,
        "--samples_per_task", "3", "--eval_repeats", "1", "--dtype", "fp32", "--lora_r", "4", "--lora_alpha", "8",
        "--learning_rate", "0.01", "--per_device_train_batch_size", "2", "--max_length", "512", "--report_to", "none",
        "--output_dir", str(tmp_path / "fbc"), "--save_strategy", "no", "--bf16", "false"])
    result = run(args, sft)
    r1 = result["rounds"][0]
    assert r1["episodes"] == 3 * 3 and 1 <= r1["tasks_kept"] <= 3 and r1["examples"] >= r1["tasks_kept"]
    assert r1["steps"] == -(-2 * r1["examples"] // 2)  # epochs 2 over the kept examples, batch 2
    assert [c["step"] for c in result["curve"]] == [0, 1]
    assert "vs_start" in result["curve"][1]["simulators"]["scripted:oracle"]
    out = capsys.readouterr().out  # progress as the episodes finish: the round's 9, each reading's one test task
    assert "train vs scripted:oracle: 9/9 episodes" in out and out.count("test vs scripted:oracle: 1/1 episodes") == 2
    # the round's adapter is an agent on the start model, and the weights moved
    trained, _ = load_generator(str(tmp_path / "fbc" / "round-1"))
    start, _ = load_generator("tiny-random")
    assert any(not torch.equal(p, start.state_dict()[n]) for n, p in trained.state_dict().items())
    # a rerun resumes: nothing left to do, the same curve
    assert run(args, sft)["curve"] == result["curve"]


def test_filtered_bc_round_that_keeps_nothing_leaves_the_agent_as_it_was(echo_gym, tmp_path, capsys):
    """No episode above the floor: no adapter, and the reading after the round (and after a resume) is of the start
    agent."""
    from trl import SFTConfig

    from agent_rl.filtered_bc import FilteredBCArgs, run

    args, sft = parse_config((FilteredBCArgs, SFTConfig), [
        "--agent_model", "tiny-random", "--gyms", echo_gym, "--eval_gyms", echo_gym, "--rounds", "1",
        "--samples_per_task", "2", "--keep_above", "1000", "--eval_repeats", "1", "--dtype", "fp32",
        "--report_to", "none", "--output_dir", str(tmp_path / "fbc"), "--bf16", "false"])
    result = run(args, sft)
    assert result["rounds"][0]["examples"] == 0 and "steps" not in result["rounds"][0]
    assert not (tmp_path / "fbc" / "round-1" / "adapter_config.json").exists()
    assert [c["agent"] for c in result["curve"]] == ["tiny-random", "tiny-random"]
    assert result["curve"][1]["simulators"]["scripted:oracle"]["vs_start"][0] == 0.0  # the same agent, same seeds
    assert run(args, sft)["curve"] == result["curve"]


def test_filtered_bc_mixed_round_plays_and_filters_each_simulator_apart(echo_gym, tmp_path, capsys):
    from trl import SFTConfig

    from agent_rl.filtered_bc import FilteredBCArgs, run

    argv = ["--agent_model", "tiny-random", "--simulator", "scripted:oracle,scripted:terse", "--gyms", echo_gym,
            "--eval_gyms", echo_gym, "--rounds", "1", "--samples_per_task", "2", "--eval_repeats", "1",
            "--dtype", "fp32", "--lora_r", "4", "--lora_alpha", "8", "--per_device_train_batch_size", "2",
            "--max_length", "512", "--report_to", "none", "--output_dir", str(tmp_path / "fbc"),
            "--save_strategy", "no", "--bf16", "false"]
    args, sft = parse_config((FilteredBCArgs, SFTConfig), argv)
    r1 = run(args, sft)["rounds"][0]
    by = r1["by_simulator"]
    assert list(by) == ["scripted:oracle", "scripted:terse"]
    assert [b["episodes"] for b in by.values()] == [6, 6] and r1["episodes"] == 12
    assert r1["tasks_kept"] == sum(b["tasks_kept"] for b in by.values())
    assert r1["examples"] == sum(b["examples"] for b in by.values())
    out = capsys.readouterr().out
    assert "train vs scripted:oracle: 6/6 episodes" in out and "train vs scripted:terse: 6/6 episodes" in out
    # a round stopped in its cloning: the rerun replays no episode, and clones the same examples
    rdir = tmp_path / "fbc" / "round-1"
    assert [json.loads((rdir / f"kept-{i}.json").read_text())["simulator"] for i in (0, 1)] == list(by)
    (rdir / "round.json").unlink()
    (tmp_path / "fbc" / "curve.jsonl").write_text((tmp_path / "fbc" / "curve.jsonl").read_text().splitlines()[0] + "\n")
    again = run(args, sft)["rounds"][0]
    assert "train vs" not in capsys.readouterr().out
    assert again["by_simulator"] == by and again["steps"] == r1["steps"]
    with pytest.raises(ConfigError, match="names a simulator twice"):
        parse_config((FilteredBCArgs, SFTConfig), [*argv[:2], "--simulator", "scripted:oracle,scripted:oracle",
                                                   *argv[4:]])
