"""The language-model judge (discriminator.lm_judge): same-context pairs and the Bradley-Terry loss, learning on a
tiny random Llama, saving and loading as its own family, its place in the meter's panel beside the old panel, the
capped pairwise reward and the length band, and objective turing_grpo end to end on the smoke preset."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from conversations import TurnRecord

ROOT = Path(__file__).resolve().parent.parent
SMOKE = str(ROOT / "configs" / "smoke.yaml")
pytestmark = pytest.mark.usefixtures("one_thread")
SMALL = {"backbone": "tiny-random", "batch_size": 8, "max_length": 64, "context_tokens": 24}


def ctx(i):
    return [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer number {i}"}]


def pairs(n, real="ok thx", sim="Certainly! I would be delighted to elaborate further on this topic.", start=0):
    items, y = [], []
    for i in range(start, start + n):
        items += [TurnRecord(id=f"c{i}", context=ctx(i), user_turn=real + "!" * (i % 3)),
                  TurnRecord(id=f"c{i}@sim", context=ctx(i), user_turn=sim)]
        y += [1, 0]
    return items, np.array(y)


def test_context_units_pair_by_context_and_leave_the_rest_pointwise():
    from discriminator.lm_judge import context_units, pair_terms

    items, y = pairs(2)
    lone = TurnRecord(id="x", context=ctx(9), user_turn="hm")
    empty = TurnRecord(id="e", context=[], user_turn="hi")
    items += [lone, empty]
    y = np.array([*y, 1, 0])
    units = context_units(items, y)
    assert units == [[0, 1], [2, 3], [4], [5]]
    assert pair_terms(units[0], y) == ([(0, 1)], [])
    assert pair_terms(units[2], y) == ([], [0])
    # two simulated turns for one real one: two pairs, both against the real turn
    assert pair_terms([0, 1, 2], np.array([1, 0, 0])) == ([(0, 1), (0, 2)], [])


def test_identical_turns_give_the_bradley_terry_loss_log_2_and_every_parameter_moves():
    from discriminator.lm_judge import LMJudge

    j = LMJudge(**SMALL)
    items, y = pairs(4, real="same text", sim="same text")
    for k in range(0, len(items), 2):  # the real and the simulated turn of a context are the same input
        items[k + 1] = TurnRecord(id=items[k + 1].id, context=items[k].context, user_turn=items[k].user_turn)
    before = {n: p.detach().clone() for n, p in j.trainable_parameters().items()}
    loss = j.update(items, y)
    assert loss == pytest.approx(math.log(2), abs=1e-5)  # f(real) - f(sim) = 0 for every pair
    items2, y2 = pairs(4)
    j.update(items2, y2)
    changed = [n for n, p in j.trainable_parameters().items() if not torch.equal(before[n], p)]
    assert len(changed) == len(before) and j.step == 2


def test_the_judge_learns_which_of_two_turns_a_person_wrote_on_unseen_contexts():
    from discriminator.lm_judge import LMJudge

    j = LMJudge(**{**SMALL, "lr": 2e-3, "head_lr": 1e-2})
    train, y = pairs(24)
    j.fit(train, y, epochs=4)
    assert j.history[-1] < j.history[0]
    test, _ = pairs(10, start=100)
    assert (j.pair_log_odds(test[0::2], test[1::2]) > 0).all()  # every unseen pair: the real turn picked


def test_a_saved_judge_loads_as_a_judge_with_the_same_scores(tmp_path):
    from discriminator.lm_judge import LMJudge
    from discriminator.neural import NeuralDetector

    items, y = pairs(6)
    j = LMJudge(**SMALL).fit(items, y)
    j.save(tmp_path / "j")
    assert json.loads((tmp_path / "j" / "discriminator.json").read_text())["family"] == "lmjudge"
    k = NeuralDetector.load(tmp_path / "j")
    assert isinstance(k, LMJudge)
    np.testing.assert_allclose(k.score(items), j.score(items), atol=1e-5)


def test_the_meter_reads_the_judge_in_its_panel_and_keeps_the_old_panel_beside_it():
    from discriminator.turing import measure_td

    real, sim = [], []
    for i in range(30):
        real.append(TurnRecord(id=f"c{i}", context=ctx(i), user_turn=f"ok {i} thx"))
        sim.append(TurnRecord(id=f"c{i}@sim", context=ctx(i), user_turn=f"Certainly! Here is item {i}."))
    r = measure_td(real, sim, detectors=("classical", "lmjudge"), folds=3, n_boot=100,
                   detector_kwargs={"lmjudge": SMALL}, return_scores=True)
    # the judge beside its n-gram member: their mean log-odds, read with no fit of its own
    assert list(r["detectors"]) == ["classical", "lmjudge", "judge+ngram"]
    scores = r["oof"]["scores"]
    np.testing.assert_allclose(scores["judge+ngram"], (scores["lmjudge"] + scores["classical"]) / 2)
    assert r["detectors"]["judge+ngram"]["fit_seconds"] == 0.0
    assert r["old_panel"]["detectors"] == ["classical"]
    assert r["old_panel"]["td"] == r["detectors"]["classical"]["td"]
    assert r["td"] == max(d["td"] for d in r["detectors"].values())
    assert r["paired_td"] == max(d["paired_td"] for d in r["detectors"].values())
    # without the judge there is no old panel to keep apart
    assert measure_td(real, sim, detectors=("classical", "style"), folds=3, n_boot=100)["old_panel"] is None


def test_the_pairwise_reward_is_capped_at_cannot_tell_and_the_length_band_is_free_inside():
    from adversary.reward import disc_reward, length_penalty

    r = disc_reward(np.array([1.0, -2.0, 0.0, -9.0]), "pairwise", 5.0, real_logits=np.array([0.0, 0.0, 0.5, 0.0]))
    np.testing.assert_allclose(r, [0.0, -2.0, -0.5, -5.0])  # more human than the human earns nothing more
    with pytest.raises(ValueError):
        disc_reward(np.zeros(2), "pairwise", 5.0)
    assert length_penalty(10, 10) == 0.0
    assert length_penalty(14, 10, band=1.5) == 0.0  # 15/11 is inside the band
    assert length_penalty(32, 10, band=1.5) == pytest.approx(-(math.log(33 / 11) - math.log(1.5)))
    assert length_penalty(32, 10) == pytest.approx(-math.log(33 / 11))


def test_turing_grpo_names_every_break_of_its_recipe_before_anything_loads(tmp_path, capsys):
    from adversary.train import main

    with pytest.raises(SystemExit) as e:
        main(["--config", SMOKE, "--output_dir", str(tmp_path / "x"), "--objective", "turing_grpo", "--beta", "0"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    for key in ("disc_family", "disc_reward", "length_band", "beta"):
        assert key in err
    assert not (tmp_path / "x" / "warmstart").exists()


def test_turing_grpo_runs_end_to_end_against_a_judge_and_exports(tmp_path):
    from adversary.train import main

    out = tmp_path / "tg"
    argv = ["--config", SMOKE, "--output_dir", str(out), "--objective", "turing_grpo", "--disc_family", "lmjudge",
            "--disc_weights", "1.0", "0.0", "--disc_reward", "pairwise", "--length_band", "1.5", "--w_length", "0.5",
            "--beta", "0.01", "--disc_lr", "1e-3"]
    assert main(argv) == 0
    manifest = json.loads((out / "frozen" / "simulator.json").read_text())
    assert manifest["objective"] == "turing_grpo"
    assert manifest["config"]["adversary"]["discriminator"]["disc_family"] == "lmjudge"
    saved = json.loads((out / "summary.json").read_text())
    assert 0 <= saved["best_td"] <= 50


def test_guide_study_writes_two_exports_that_differ_only_in_their_guide(tmp_path, tiny_lm_path):
    """adversary.guide_study: the n-gram guide and the judge's guide, both calibrated on pairs neither saw, each in
    an export of the same weights that loads with its own guide family."""
    from adversary.guide_study import main
    from agent_rl.users import load_simulator
    from conversations import write_jsonl
    from discriminator.lm_judge import LMJudge

    items, y = pairs(40)
    write_jsonl(tmp_path / "real.jsonl", [it for it, lab in zip(items, y) if lab == 1])
    write_jsonl(tmp_path / "sim.jsonl", [it for it, lab in zip(items, y) if lab == 0])
    judge = LMJudge(**SMALL)
    judge.fit(items[:40], y[:40], calibrate=False)
    judge.save(tmp_path / "judge")
    out = tmp_path / "guides"
    assert main(["--model", tiny_lm_path, "--judge", str(tmp_path / "judge"), "--train-real", str(tmp_path / "real.jsonl"),
                 "--train-sim", str(tmp_path / "sim.jsonl"), "--out", str(out), "--fit-pairs", "20",
                 "--calib-pairs", "20", "--max-new-tokens", "4"]) == 0
    doc = json.loads((out / "guide_study.json").read_text())
    assert set(doc["guides"]) == {"classical", "lmjudge"}
    assert doc["guides"]["classical"]["paired_accuracy"] == 100.0  # "ok thx" against a polite paragraph
    weights = {name: (out / name / "model.safetensors").read_bytes() for name in ("classical", "lmjudge")}
    assert weights["classical"] == weights["lmjudge"]
    judged = load_simulator(f"frozen:{out / 'lmjudge'}")
    assert type(judged.guide.disc.neural).__name__ == "LMJudge" and judged.guide.k == 4
    assert load_simulator(f"frozen:{out / 'classical'}").guide.disc.neural is None


def test_a_loaded_judge_keeps_its_weights_and_the_ngram_member_learns_the_warm_starts_turns(tmp_path):
    """judge_init with disc_weights [1, 1]: the judge comes warmed up (not fitted again), and the n-gram member is
    fitted on the warm start's own turns for the fit contexts, so the ensemble scores with both members."""
    from adversary.stages import fit_discriminator, make_discriminator, prepare_data
    from adversary.train import parse_args
    from discriminator.lm_judge import LMJudge
    from generator.model import load_generator

    judge = LMJudge(**SMALL)
    judge.fit(*pairs(8), calibrate=False)
    judge.save(tmp_path / "judge")
    cfg, args = parse_args(["--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--disc_family", "lmjudge",
                            "--disc_weights", "1.0", "1.0", "--judge_init", str(tmp_path / "judge"),
                            "--disc_max_length", "64", "--disc_context_tokens", "24"])
    data = prepare_data(cfg, args.seed)
    model, tok = load_generator(cfg.model)
    disc = make_discriminator(cfg, args.seed)
    fit = fit_discriminator(cfg, disc, model, tok, data, args.seed)
    assert fit["disc/init_items"] == 2 * len(data.disc_fit) > 0
    assert disc.classical is not None and len(disc.pool) == fit["disc/init_items"]
    for name, p in judge.trainable_parameters().items():
        torch.testing.assert_close(disc.neural.trainable_parameters()[name], p)
    assert set(disc.member_scores(data.disc_fit[:4])) == {"neural", "classical"}


def test_judge_study_reads_a_loaded_judge_the_ngram_classifier_and_their_average_on_the_same_pairs(tmp_path):
    from adversary.judge_study import main
    from conversations import write_jsonl
    from discriminator.lm_judge import LMJudge

    items, y = pairs(40)
    real, sim = [it for it, lab in zip(items, y) if lab == 1], [it for it, lab in zip(items, y) if lab == 0]
    write_jsonl(tmp_path / "real.jsonl", real[:30])
    write_jsonl(tmp_path / "sim.jsonl", sim[:30])
    write_jsonl(tmp_path / "real_test.jsonl", real[30:])
    write_jsonl(tmp_path / "sim_test.jsonl", sim[30:])
    judge = LMJudge(**SMALL)
    judge.fit(items[:20], y[:20], calibrate=False)
    judge.save(tmp_path / "judge")
    out = tmp_path / "study"
    argv = ["--train-real", str(tmp_path / "real.jsonl"), "--train-sim", str(tmp_path / "sim.jsonl"),
            "--test-real", str(tmp_path / "real_test.jsonl"), "--test-sim", str(tmp_path / "sim_test.jsonl"),
            "--out", str(out), "--pairs", "30", "--judge", str(tmp_path / "judge"),
            "--skip", "ensemble/demo", "ensemble/same"]
    assert main(argv) == 0
    doc = json.loads((out / "judge_study.json").read_text())
    parts = doc["parts"]
    assert set(parts) == {"lmjudge", "ngram/same", "judge+ngram"}
    assert parts["lmjudge"]["loaded_from"] == str(tmp_path / "judge") and parts["lmjudge"]["n_pairs"] == 10
    assert parts["ngram/same"]["paired_accuracy"] == 100.0  # "ok thx" against a polite paragraph
    mean = (np.array(parts["lmjudge"]["scores"]) + np.array(parts["ngram/same"]["scores"])) / 2
    np.testing.assert_allclose(parts["judge+ngram"]["scores"], mean, atol=1e-4)
    d = mean[:10] - mean[10:]
    assert parts["judge+ngram"]["paired_accuracy"] == pytest.approx(100 * np.mean((d > 0) + 0.5 * (d == 0)))
    assert "judge_ngram_minus_ensemble_same" not in doc  # its partner was skipped
    assert main(argv) == 0  # a second run resumes: nothing is read again
    assert json.loads((out / "judge_study.json").read_text())["parts"]["lmjudge"] == parts["lmjudge"]
