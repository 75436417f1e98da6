"""The distillation objectives (adversary/distill.py, objectives dpg and bond): exact values of their pure pieces,
the weighted step against the NLL it generalises, the warm start's log-probs through the switched-off adapter, and
both objectives through the main job's phase loop."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SMOKE = str(ROOT / "configs" / "smoke.yaml")
pytestmark = pytest.mark.usefixtures("one_thread")


def test_group_weights_normalise_each_row_and_give_unusable_samples_nothing():
    from adversary.distill import group_weights

    w = group_weights(np.array([[0.0, np.log(3.0), -np.inf], [-np.inf, -np.inf, -np.inf], [1000.0, 1000.0, 0.0]]))
    np.testing.assert_allclose(w, [[0.25, 0.75, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.0]], atol=1e-12)


def test_bond_quantiles_and_coefficients_exact():
    from adversary.objectives.bond import bond_coefficients, quantiles

    z = np.array([[0.3, -1.0, 2.0, 0.5]])
    usable = np.array([[True, True, True, False]])  # the last is cut: it ranks below every usable sample
    np.testing.assert_allclose(quantiles(z, usable), [[0.75, 0.5, 1.0, 0.25]])
    c0 = bond_coefficients(z, usable, 0.0)  # beta 0: best-of-K SFT, the NLL of the best usable sample only
    np.testing.assert_allclose(c0, [[0.0, 0.0, 1.0, 0.0]])
    R = 3 * np.log([0.75, 0.5, 1.0, 0.25])
    want = 4 * (R - R.mean()) / (3 * np.log(4))
    np.testing.assert_allclose(bond_coefficients(z, usable, 1.0), [want])
    np.testing.assert_allclose(bond_coefficients(z, usable, 0.5), 0.5 * c0 + 0.5 * want[None])
    assert bond_coefficients(z, usable, 1.0).sum() == pytest.approx(0.0)  # the backward term's baseline


def test_round_calibration_fits_platt_on_the_fresh_pairs():
    from adversary.distill import calibrate_round

    rng = np.random.default_rng(0)
    # real ~ N(1, 1), simulated ~ N(-1, 1): the true log-odds of x are 2x; a scorer giving 4x is twice too sharp
    real, sim = rng.normal(1.0, 1.0, 400), rng.normal(-1.0, 1.0, 400)
    scaler, fig = calibrate_round(4.0 * real, 4.0 * sim)
    assert 0.35 < scaler.a < 0.65 and abs(scaler.b) < 0.2
    assert fig["round/calib_ece"] <= fig["round/calib_ece_raw"]


def _lm(tiny_lm_path):
    from peft import get_peft_model

    from generator.model import load_generator, lora_config

    model, tok = load_generator(tiny_lm_path)
    return get_peft_model(model, lora_config(4, 8)), tok


def _records(n=6):
    from conversations.schema import TurnRecord

    return [TurnRecord(id=f"c{i}", context=[{"role": "assistant", "content": f"How can I help {i}?"}],
                       user_turn=f"fix my code number {i} please", is_last=i % 2 == 0) for i in range(n)]


def test_weighted_step_with_unit_coefficients_is_the_token_mean_nll(tiny_lm_path):
    from adversary.distill import WeightedTurn, _encode, sequence_logprobs, weighted_steps

    model, tok = _lm(tiny_lm_path)
    recs = _records(4)
    kw = dict(precision="fp32", max_context_tokens=64, max_length=128)
    logp = sequence_logprobs(model, tok, recs, **kw)
    n_tok = sum(sum(m) for _, m in _encode(tok, recs, 64, 128))
    steps, loss, _ = weighted_steps(model, tok, [WeightedTurn(r, 1.0) for r in recs], lr=1e-3, batch_size=4,
                                    micro_batch=2, **kw)
    assert steps == 1 and loss == pytest.approx(-logp.sum() / n_tok, rel=1e-4)


def test_the_reference_is_the_model_without_its_adapter_and_a_step_moves_every_lora_weight(tiny_lm_path):
    from adversary.distill import WeightedTurn, sequence_logprobs, weighted_steps

    model, tok = _lm(tiny_lm_path)
    recs = _records(4)
    kw = dict(precision="fp32", max_context_tokens=64, max_length=128)
    np.testing.assert_allclose(sequence_logprobs(model, tok, recs, reference=True, **kw),
                               sequence_logprobs(model, tok, recs, **kw), rtol=1e-5)  # LoRA B = 0: the same model
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    # coefficients of both signs: the first two turns pushed up, the last two down
    weighted_steps(model, tok, [WeightedTurn(r, c) for r, c in zip(recs, [2.0, 1.0, -1.0, -2.0])], lr=1e-2,
                   batch_size=4, micro_batch=4, **kw)
    weighted_steps(model, tok, [WeightedTurn(r, c) for r, c in zip(recs, [2.0, 1.0, -1.0, -2.0])], lr=1e-2,
                   batch_size=4, micro_batch=4, **kw)
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters() if p.requires_grad)
    after_ref = sequence_logprobs(model, tok, recs, reference=True, **kw)
    after = sequence_logprobs(model, tok, recs, **kw)
    assert not np.allclose(after_ref, after, rtol=1e-4)
    assert after[0] - after_ref[0] > after[3] - after_ref[3]  # up-weighted turn gained on the down-weighted one


def _phase(tmp_path, tiny_lm_path, objective, *extra):
    from adversary.objectives import get_objective
    from adversary.objectives.base import Phase
    from adversary.state import AdversaryState
    from adversary.stages import make_discriminator, prepare_data
    from adversary.train import parse_args

    cfg, args = parse_args(["--config", SMOKE, "--output_dir", str(tmp_path), "--objective", objective,
                            "--round_contexts", "4", "--distill_candidates", "3", "--warmstart_batch_size", "4",
                            "--warmstart_micro_batch", "2", "--distill_lr", "0.01", *extra])
    data = prepare_data(cfg, args.seed)
    model, tok = _lm(tiny_lm_path)
    state = AdversaryState(cfg, make_discriminator(cfg, args.seed), max_steps=None, seed=0)
    return get_objective(objective)(Phase(cfg, args, model, tok, state, data)), data


def test_dpg_weights_are_the_calibrated_density_ratio_at_the_first_round_and_train_every_lora_weight(
        tmp_path, tiny_lm_path):
    from generator.sample import SimulatedTurn

    obj, data = _phase(tmp_path, tiny_lm_path, "dpg")
    contexts = data.grpo[:4]
    samples = [[SimulatedTurn(f"first {i}", False, False), SimulatedTurn(f"second {i}", True, False),
                SimulatedTurn("cut", False, True)] for i in range(4)]
    raw = np.tile([0.0, np.log(3.0), 4.0], (4, 1))
    obj.sample_round = lambda k, n, temperature=None, top_p=None: (contexts, samples, raw)
    obj.real_scores = lambda ctx: np.full(len(ctx), 1.0)
    seen = {}
    real = obj.coefficients

    def spy(z, usable, c, s):
        seen["z"], seen["usable"] = z, usable
        seen["coef"], fig = real(z, usable, c, s)
        return seen["coef"], fig

    obj.coefficients = spy
    model = obj.phase.model
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    fig = obj.train_round(0, 0)
    # pi = a before the first step: w = softmax of the calibrated log-odds over the usable samples, c = K w - 1
    w = np.exp(seen["z"][:, :2]) / np.exp(seen["z"][:, :2]).sum(1, keepdims=True)
    np.testing.assert_allclose(seen["coef"][:, :2], 3 * w - 1, atol=1e-6)
    np.testing.assert_allclose(seen["coef"][:, 2], -1.0)  # the cut sample: weight 0
    np.testing.assert_allclose(seen["coef"].sum(1), 0.0, atol=1e-9)
    assert fig["round/log_ratio_mean"] == pytest.approx(0.0, abs=1e-4)
    assert fig["round/turns"] == 4 * 3 + 4 and fig["round/steps"] == 4  # 12 own + 4 real turns, batch 4
    after = dict(obj.phase.model.named_parameters())
    assert all(not torch.equal(before[n], after[n]) for n in before)


def _train(out, *extra):
    from adversary.train import main

    argv = ["--config", SMOKE, "--output_dir", str(out), "--round_contexts", "4", "--max_steps", "1000",
            "--distill_candidates", "2", *extra]
    assert main(argv) == 0
    return json.loads((out / "rounds.json").read_text()), json.loads((out / "frozen" / "simulator.json").read_text())


def test_dpg_runs_the_main_job_end_to_end(tmp_path):
    """bond shares every piece but its coefficients; it runs end to end in the study test below."""
    rounds, manifest = _train(tmp_path / "dpg", "--objective", "dpg", "--max_rounds", "2")
    assert [r["round"] for r in rounds] == [0, 1] and all(r["round/steps"] > 0 for r in rounds)
    assert all("round/calib_a" in r and r["disc/acc"] is not None for r in rounds)
    assert rounds[1]["round/log_ratio_mean"] != 0.0  # round 1 samples a trained adapter: pi is not the warm start
    assert manifest["objective"] == "dpg"


def test_the_study_reads_each_arm_along_its_time(tmp_path):
    """arm_readings 2: the sft arm and a distillation arm are each saved half way and read there as ARM@1, beside
    their ends, on the same contexts and seeds."""
    import subprocess
    import sys

    out = tmp_path / "study"
    cmd = [sys.executable, "-m", "adversary.study", "--config", SMOKE, "--out", str(out),
           "--arms", "sft", "bond:objective=bond,round_contexts=4,distill_candidates=2,warmstart_batch_size=4",
           "--arm_seconds", "12", "--arm_readings", "2", "--study_contexts", "20", "--val_contexts", "20",
           "--temperatures", "1.0", "--study_detectors", "classical", "--study_folds", "2", "--n_boot", "50",
           "--plateau_steps", "2", "--plateau_eval_every", "2", "--study_seeds", "3001", "--score_warmstart", "false"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    study = json.loads((out / "study.json").read_text())
    assert set(study["arms"]) == {"sft", "sft@1", "bond", "bond@1"}
    for arm in ("sft", "bond"):
        half, end = study["arms"][f"{arm}@1"], study["arms"][arm]
        assert 6 <= half["train_wall_seconds"] < end["train_wall_seconds"] and half["steps"] <= end["steps"]
    assert {"sft@1-bond@1", "sft-bond"} <= set(study["differences"])
