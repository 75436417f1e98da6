"""The co-trained discriminator ensemble, the DPO rounds objective's pieces, and a rounds run end to end with
a resume."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from adversary.config import AdversaryConfig
from conversations import TurnRecord

ROOT = Path(__file__).resolve().parent.parent
CTX = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! How can I help?"}]


def _items(n, seed=0):
    rng = np.random.default_rng(seed)
    real = [TurnRecord(id=f"r{i}", context=CTX, user_turn=f"fix my {w} pls" if i % 2 else f"{w}??")
            for i, w in enumerate(rng.choice(["printer", "code", "essay", "bike", "router"], n))]
    sim = [TurnRecord(id=f"s{i}", context=CTX, user_turn=f"Could you please provide a detailed explanation of {w}?")
           for i, w in enumerate(rng.choice(["printers", "coding", "essays", "bikes", "routers"], n))]
    return real + sim, np.array([1] * n + [0] * n)


def test_ensemble_scores_saves_and_restores_identically(tmp_path, tiny_encoder_path):
    import torch

    from adversary.discriminator import Discriminator
    from discriminator.neural import NeuralDetector

    torch.set_num_threads(1)
    items, y = _items(40)

    def make():
        neural = NeuralDetector(backbone=tiny_encoder_path, max_length=48, context_tokens=16, batch_size=16, seed=0)
        return Discriminator(neural, classical=True, weights=(1.0, 2.0), pool_size=64, seed=0)

    d = make().fit(items, y, epochs=1)
    parts = d.member_scores(items)
    np.testing.assert_allclose(d.score(items), (parts["neural"] + 2 * parts["classical"]) / 3)
    assert ((d.score(items) > 0) == y).mean() > 0.9  # the classical member alone separates this
    more, y2 = _items(20, seed=1)
    d.observe(more, y2)
    assert len(d.pool) == 64  # bounded: the newest pool_size turns
    d.update(more[:4], y2[:4])
    d.save(tmp_path / "disc")
    e = make().load(tmp_path / "disc")
    assert e.fingerprint() == d.fingerprint()
    np.testing.assert_allclose(e.score(items), d.score(items), atol=1e-6)
    only = Discriminator(None, classical=True, weights=(0.0, 1.0)).fit(items, y)
    assert only.model is None and only.score(items).shape == (80,)


def test_round_pairs_pick_the_extremes_and_never_a_cut_turn():
    from adversary.rounds import build_pairs
    from generator.sample import SimulatedTurn

    cfg = AdversaryConfig(round_samples=3, round_min_margin=0.5)
    ctx = [TurnRecord(id=f"c{i}", context=CTX, user_turn=f"real {i}", is_last=i == 1) for i in range(3)]
    turns = [[SimulatedTurn("a", False, False), SimulatedTurn("b", True, False), SimulatedTurn("c", False, True)],
             [SimulatedTurn("d", False, False), SimulatedTurn("e", False, False), SimulatedTurn("f", False, False)],
             [SimulatedTurn("g", False, True), SimulatedTurn("h", False, True), SimulatedTurn("i", False, True)]]
    scores = np.array([[0.0, 1.0, 9.0],   # the best (9.0) is cut: chosen is "b" (ended: its marker goes back on)
                       [0.1, 0.3, 0.2],   # margin 0.2 < 0.5: dropped
                       [1.0, 2.0, 3.0]])  # every sample cut: no chosen
    rows, fig = build_pairs(cfg, ctx, turns, scores)
    assert [(r["chosen"], r["rejected"]) for r in rows] == [("b\n<|endconversation|>", "a")]
    assert fig["round/pairs"] == 1
    real = AdversaryConfig(round_samples=3, round_chosen="real")
    rows, _ = build_pairs(real, ctx, turns, scores)
    assert [(r["chosen"], r["rejected"]) for r in rows] == [("real 0", "a"), ("real 1\n<|endconversation|>", "d"),
                                                            ("real 2", "g")]


def test_round_contexts_cover_the_pool_before_repeating():
    from adversary.rounds import round_contexts

    class D:
        grpo = [TurnRecord(id=str(i), context=[], user_turn="x") for i in range(10)]

    cfg = AdversaryConfig(round_contexts=3)
    seen = [r.id for k in range(3) for r in round_contexts(D, cfg, k, seed=0)]
    assert len(seen) == 9 and len(set(seen)) == 9  # three rounds of one pass: no context twice
    assert [r.id for r in round_contexts(D, cfg, 1, seed=0)] == [r.id for r in round_contexts(D, cfg, 1, seed=0)]


def _launch(out, *extra):
    cmd = ["accelerate", "launch", "--config_file", str(ROOT / "configs" / "accelerate" / "cpu.yaml"),
           "--num_cpu_threads_per_process", "2", str(ROOT / "adversary" / "train.py"), "--config",
           str(ROOT / "configs" / "smoke.yaml"), "--output_dir", str(out), "--objective", "dpo_rounds",
           "--round_contexts", "8", "--dpo_batch_size", "4", "--dpo_micro_batch", "2", "--round_chosen", "real",
           "--dpo_sft_weight", "1", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)


def test_dpo_rounds_run_end_to_end_and_resume(tmp_path):
    out = tmp_path / "rounds"
    r = _launch(out, "--max_rounds", "2")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rounds = json.loads((out / "rounds.json").read_text())
    assert [x["round"] for x in rounds] == [0, 1] and all(x["round/pairs"] == 8 for x in rounds)
    steps = [x["step"] for x in rounds]
    assert steps == [2, 4]  # 8 pairs / 4 per step, each round
    manifest = json.loads((out / "frozen" / "simulator.json").read_text())
    assert manifest["objective"] == "dpo_rounds" and [row["step"] for row in manifest["td_curve"]] == [0, 2, 4]
    # a third round from the checkpoint of the second: the run state comes back in one call, nothing is repeated
    r = _launch(out, "--max_rounds", "3", "--max_steps", "6", "--resume_from_checkpoint", "latest")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rounds = json.loads((out / "rounds.json").read_text())
    assert [x["round"] for x in rounds] == [2] and rounds[0]["step"] == 6
    manifest = json.loads((out / "frozen" / "simulator.json").read_text())
    assert [row["step"] for row in manifest["td_curve"]] == [0, 2, 4, 6]


@pytest.mark.parametrize("checkpointing", [True, False])
def test_a_dpo_round_trains_every_lora_parameter_and_checkpointing_changes_nothing_else(tmp_path, tiny_lm_path,
                                                                                        checkpointing):
    """One round of `train_round` (TRL's DPOTrainer, pairs padded to DPO_PAD_MULTIPLE): every LoRA parameter
    moves, no other does, and recomputing activations (`dpo_checkpointing`) gives the same losses and weights."""
    import torch
    from peft import get_peft_model
    from trl import GRPOConfig

    from adversary.rounds import train_round
    from generator.model import load_generator, lora_config

    cfg = AdversaryConfig(dpo_batch_size=2, dpo_micro_batch=1, dpo_lr=1e-2, warmstart_max_length=64,
                          heldout_max_new_tokens=16, max_context_tokens=48, dtype="fp32", dpo_sft_weight=1.0,
                          dpo_checkpointing=checkpointing)
    args = GRPOConfig(output_dir=str(tmp_path), seed=0, use_cpu=True, report_to="none")
    rows = [{"prompt_context": CTX, "chosen": "fix it pls", "rejected": "Could you kindly explain in detail?"},
            {"prompt_context": CTX, "chosen": "nope", "rejected": "Certainly! Here is a thorough overview."}] * 2

    def run():
        torch.manual_seed(0)
        base, tok = load_generator(tiny_lm_path)
        model = get_peft_model(base, lora_config(4, 8))
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        model, history, steps = train_round(cfg, args, model, tok, rows, tmp_path / "dpo", 0)
        end = dict(model.named_parameters())
        assert model.get_base_model().is_activation_checkpointing == cfg.dpo_checkpointing  # what TRL was told
        return start, end, [h["loss"] for h in history if "loss" in h], steps

    start, end, losses, steps = run()
    assert steps == 2 and len(losses) == 2
    lora = [n for n in start if "lora_" in n]
    assert lora and all(not torch.equal(start[n], end[n]) for n in lora)
    assert all(torch.equal(start[n], end[n]) for n in start if n not in lora)
    cfg.dpo_checkpointing = not checkpointing
    start2, end2, losses2, _ = run()
    assert losses2 == pytest.approx(losses, rel=1e-4)
    assert all(torch.allclose(end[n], end2[n], atol=1e-5) for n in lora)
