"""The objectives behind one interface: a toy objective registered in a few lines runs the main job's phase loop
end to end; spin and resample_sft run end to end (spin resumes with its pair history); TaiLr's and MixCE's token
losses."""

import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SMOKE = str(ROOT / "configs" / "smoke.yaml")
pytestmark = pytest.mark.usefixtures("one_thread")


def _train(out, *extra):
    from adversary.train import main

    argv = ["--config", SMOKE, "--output_dir", str(out), "--round_contexts", "8", "--max_steps", "1000", *extra]
    assert main(argv) == 0
    return json.loads((out / "rounds.json").read_text()), json.loads((out / "frozen" / "simulator.json").read_text())


def test_a_toy_objective_is_a_few_lines_and_runs_the_phase_loop_end_to_end(tmp_path):
    from adversary.objectives import available, register
    from adversary.objectives.base import RoundsObjective

    @register("toy")
    class Toy(RoundsObjective):  # one SGD step on a real turn per round, the discriminator co-trained
        def train_round(self, k, step):
            contexts, samples, _ = self.sample_round(k, 2)
            params = [p for p in self.phase.model.parameters() if p.requires_grad]
            ids = self.phase.tokenizer(contexts[0].user_turn, return_tensors="pt").input_ids
            self.phase.model(input_ids=ids, labels=ids).loss.backward()
            torch.optim.SGD(params, lr=1.0).step()
            return {"round/steps": 1, **self.cotrain(contexts, samples, step + 1)}

    assert "toy" in available()
    rounds, manifest = _train(tmp_path / "toy", "--objective", "toy", "--max_rounds", "2")
    assert [r["round"] for r in rounds] == [0, 1] and [r["step"] for r in rounds] == [1, 2]
    assert manifest["objective"] == "toy" and [row["step"] for row in manifest["td_curve"]] == [0, 1, 2]
    best = json.loads((tmp_path / "toy" / "best" / "best.json").read_text())
    assert best["step"] == manifest["best"]["step"]
    # the phase trained the adapter: every LoRA matrix of the newest round differs from a fresh adapter's zero B
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "toy" / "round-0001" / "adapter_model.safetensors"))
    lora_b = [v for n, v in weights.items() if "lora_B" in n]
    assert lora_b and all(v.abs().sum() > 0 for v in lora_b)


def test_an_unknown_objective_is_refused_with_the_choices():
    from adversary.config import AdversaryConfig
    from conversations.config import ConfigError

    with pytest.raises(ConfigError, match="objective must be one of .*dpo_rounds.*grpo.*resample_sft.*spin"):
        AdversaryConfig(objective="ppo")


def test_spin_keeps_every_iterations_pairs_trains_epochs_and_resumes_with_them(tmp_path):
    out = tmp_path / "spin"
    common = ["--objective", "spin", "--dpo_batch_size", "4", "--dpo_micro_batch", "2", "--spin_epochs", "2",
              "--dpo_sft_weight", "1"]
    rounds, manifest = _train(out, *common, "--max_rounds", "2")
    assert [r["round/pairs_new"] for r in rounds] == [8, 8] and [r["round/pairs"] for r in rounds] == [8, 16]
    assert [r["step"] for r in rounds] == [4, 12]  # 8 pairs x 2 epochs / 4, then 16 x 2 / 4
    assert all(r["round/dpo_margin"] is not None and r["round/dpo_chosen"] is not None for r in rounds)
    assert manifest["objective"] == "spin"
    # the third iteration, resumed: the first two iterations' pairs come back from the round folder
    rounds, manifest = _train(out, *common, "--max_rounds", "3", "--resume_from_checkpoint", "latest")
    assert [r["round"] for r in rounds] == [2] and rounds[0]["round/pairs"] == 24 and rounds[0]["step"] == 12 + 12
    assert [row["step"] for row in manifest["td_curve"]] == [0, 4, 12, 24]


def test_spin_with_a_short_history_trains_on_the_newest_iterations_only(tmp_path):
    rounds, _ = _train(tmp_path / "spin1", "--objective", "spin", "--dpo_batch_size", "4", "--dpo_micro_batch", "2",
                       "--spin_epochs", "1", "--spin_history", "1", "--dpo_loss", "apo_zero", "--max_rounds", "3")
    assert [r["round/pairs"] for r in rounds] == [8, 16, 16]


def test_resample_sft_runs_end_to_end(tmp_path):
    # the tiny random model never ends a turn within the budget: nothing may be kept, and the round takes no step
    rounds, manifest = _train(tmp_path / "rs", "--objective", "resample_sft", "--resample_candidates", "2",
                              "--max_rounds", "1")
    (r,) = rounds
    assert r["round/truncated_rate"] == 1.0 and r["round/kept"] == 0 and r["round/steps"] == 0
    assert manifest["objective"] == "resample_sft"


def test_resample_sft_keeps_one_whole_sample_per_context_and_trains_on_it_beside_real_turns(tmp_path, tiny_lm_path):
    import numpy as np
    from peft import get_peft_model

    from adversary.objectives.base import Phase
    from adversary.objectives.resample_sft import ResampleSFT
    from adversary.state import AdversaryState
    from adversary.stages import make_discriminator, prepare_data
    from adversary.train import parse_args
    from generator.model import load_generator, lora_config
    from generator.sample import SimulatedTurn

    cfg, args = parse_args(["--config", SMOKE, "--output_dir", str(tmp_path), "--round_contexts", "6",
                            "--resample_candidates", "3", "--warmstart_lr", "0.05"])
    data = prepare_data(cfg, args.seed)
    model, tok = load_generator(tiny_lm_path)
    model = get_peft_model(model, lora_config(4, 8))
    state = AdversaryState(cfg, make_discriminator(cfg, args.seed), max_steps=None, seed=0)
    obj = ResampleSFT(Phase(cfg, args, model, tok, state, data))
    contexts = data.grpo[:6]
    # per context: a cut turn with the best score, a whole one, an empty one; context 5 has nothing usable
    samples = [[SimulatedTurn("cut off mid", False, True), SimulatedTurn(f"whole turn {i}", i % 2 == 0, False),
                SimulatedTurn("", False, False)] for i in range(5)] + [[SimulatedTurn("cut", False, True)] * 3]
    scores = np.tile([5.0, 0.0, 3.0], (6, 1))
    obj.sample_round = lambda k, n: (contexts, samples, scores)
    seen = {}
    real_sft = obj.sft
    obj.sft = lambda records, seed: (seen.setdefault("records", records), real_sft(records, seed))[1]
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    fig = obj.train_round(0, 0)
    kept = [r for r in seen["records"] if r.id.endswith("@resampled")]
    assert [r.user_turn for r in kept] == [f"whole turn {i}" for i in range(5)]  # never the cut or the empty one
    assert [r.is_last for r in kept] == [True, False, True, False, True]  # an ended sample keeps its end marker
    assert fig["round/kept"] == 5 and fig["round/real"] == 5 and fig["round/steps"] == 3  # 10 turns, batch 4
    assert fig["round/ess_mean"] == pytest.approx(1.0)
    after = dict(obj.phase.model.named_parameters())
    assert all(not torch.equal(before[n], after[n]) for n in before)  # every LoRA parameter trained


def _nll(logits, labels):
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                             ignore_index=-100)


def test_tailr_at_gamma_0_is_the_nll_and_weights_each_token_by_its_probability():
    from types import SimpleNamespace

    from generator.token_losses import tailr_loss

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 11, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (2, 6), generator=g)
    labels[:, :2] = -100  # the prompt
    out = SimpleNamespace(logits=logits)
    torch.testing.assert_close(tailr_loss(0.0)(out, labels), _nll(logits, labels))
    # gamma 1: weight p; the per-token weights are detached, so the gradient is sum p * grad log p / n
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
    mask = labels[:, 1:] != -100
    want = -(logp.detach().exp() * logp * mask).sum() / mask.sum()
    torch.testing.assert_close(tailr_loss(1.0)(out, labels), want)
    torch.testing.assert_close(tailr_loss(0.5)(out, labels, num_items_in_batch=torch.tensor(4)),
                               -(logp.detach().exp() / (0.5 + 0.5 * logp.detach().exp()) * logp * mask).sum() / 4)
    # the gradient of the weighted loss is the weighted gradient of log p (the weights carry none)
    tailr_loss(1.0)(out, labels).backward()
    grad = logits.grad.clone()
    logits.grad = None
    (-(logp.detach().exp() * logp * mask).sum() / mask.sum()).backward()
    torch.testing.assert_close(logits.grad, grad)


def test_mixce_at_eta_1_is_the_nll_and_never_weights_a_token_below_eta():
    from types import SimpleNamespace

    from generator.token_losses import mixce_loss

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 6, 11, generator=g)
    labels = torch.randint(0, 11, (2, 6), generator=g)
    labels[:, :3] = -100
    out = SimpleNamespace(logits=logits)
    torch.testing.assert_close(mixce_loss(1.0)(out, labels), _nll(logits, labels))
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
    mask = labels[:, 1:] != -100
    p = logp.exp()
    for eta in (0.0, 0.3):
        want = -((eta + (1 - eta) * p) * logp * mask).sum() / mask.sum()
        torch.testing.assert_close(mixce_loss(eta)(out, labels), want)
    # eta 0 weights by p alone: TaiLr at gamma 1
    from generator.token_losses import tailr_loss

    torch.testing.assert_close(mixce_loss(0.0)(out, labels), tailr_loss(1.0)(out, labels))


def test_the_sft_trainer_takes_the_weighted_token_losses(tiny_lm_path, tmp_path):
    from conversations import TurnRecord
    from generator.model import load_generator
    from generator.sft import SFTArgs, make_trainer, sft_config

    model, tok = load_generator(tiny_lm_path)
    recs = [TurnRecord(id=f"r{i}", context=[{"role": "user", "content": "hi"}], user_turn="fix it pls") for i in range(4)]
    config = sft_config(output_dir=str(tmp_path), max_steps=1, max_length=256, per_device_train_batch_size=2)
    losses = {}
    for name, loss, value in (("tailr0", "tailr", 0.0), ("tailr1", "tailr", 1.0), ("mixce1", "mixce", 1.0),
                              ("mixce05", "mixce", 0.5)):
        args = SFTArgs(model=tiny_lm_path, loss=loss, tailr_gamma=value, mixce_eta=value, max_context_tokens=64)
        trainer = make_trainer(args, config, model, tok, recs)
        batch = next(iter(trainer.get_train_dataloader()))
        with torch.no_grad():
            losses[name] = float(trainer.compute_loss(model, dict(batch)))
    plain = make_trainer(SFTArgs(model=tiny_lm_path, max_context_tokens=64), config, model, tok, recs)
    batch = next(iter(plain.get_train_dataloader()))
    with torch.no_grad():
        nll = float(plain.compute_loss(model, dict(batch)))
    assert losses["tailr0"] == pytest.approx(nll, rel=1e-4)
    assert losses["mixce1"] == pytest.approx(nll, rel=1e-4)
    assert losses["tailr1"] < losses["mixce05"] < nll  # weights p < 0.5 + 0.5 p < 1
