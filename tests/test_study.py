"""The controlled study end to end with tiny models: every arm trains the same number of steps from one warm start,
is scored on the same held-out contexts, and the paired differences come with CIs."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from adversary.study import _panel_td, paired_differences

ROOT = Path(__file__).resolve().parent.parent


def test_panel_td_on_weighted_resample_exact():
    correct = np.array([[1, 1, 0, 0], [1, 1, 1, 0]], dtype=bool)  # detector 2 is right on 3 of 4
    assert _panel_td(correct, np.ones(4)) == 25.0
    assert _panel_td(correct, np.array([0, 1, 0, 1.0])) == 0.0  # both right on item 2, wrong on item 4
    assert _panel_td(correct, np.array([0, 0, 1, 1.0])) == 50.0  # detector 1 wrong on both: the strictest judge counts
    assert _panel_td(correct, np.array([2, 0, 0, 0.0])) == 50.0


def test_paired_differences_sign_and_ci():
    ids = [f"c{i}" for i in range(40)]
    y = np.array([1] * 40 + [0] * 40)
    good = np.where(y == 1, 1.0, -1.0)  # a detector that is always right: td 50
    coin = np.where(np.arange(80) % 2 == 0, 1.0, -1.0)  # right half the time: td 0
    reports = {
        "adversarial": {"td": 0.0, "oof": {"labels": y, "scores": {"d": coin}, "ids": ids + ids}},
        "sft": {"td": 50.0, "oof": {"labels": y, "scores": {"d": good}, "ids": ids + ids}},
    }
    d = paired_differences(reports, ids, n_boot=200, seed=0)["adversarial-sft"]
    assert d["td_difference"] == -50.0 and d["ci95"][1] < 0 and d["share_of_resamples_a_lower"] == 1.0


def test_arm_specs_parse_and_override_typed_fields():
    from adversary.config import AdversaryConfig
    from adversary.study import arm_config, parse_arm
    from conversations.config import ConfigError

    assert parse_arm("dpo_real:objective=dpo_rounds,round_chosen=real, dpo_beta=0.2") == (
        "dpo_real", {"objective": "dpo_rounds", "round_chosen": "real", "dpo_beta": "0.2"}, {})
    assert parse_arm("sft") == ("sft", {}, {})
    # the guidance keys are the arm's, not the config's
    assert parse_arm("sft_guided:guidance=4,dpo_beta=0.2") == ("sft_guided", {"dpo_beta": "0.2"},
                                                                {"k": 4, "rule": "resample"})
    assert parse_arm("g:guidance=2,guide_rule=argmax")[2] == {"k": 2, "rule": "argmax"}
    for bad in ("g:guidance=1", "g:guidance=four", "g:guidance=4,guide_rule=best"):
        with pytest.raises(ConfigError, match="guided arm"):
            parse_arm(bad)

    class Args:
        learning_rate = 1e-4

    cfg, args = arm_config(AdversaryConfig(), Args(), {"dpo_beta": "0.2", "round_samples": "6", "learning_rate": "5e-5"})
    assert cfg.dpo_beta == 0.2 and cfg.round_samples == 6 and args.learning_rate == 5e-5
    # a list field: its items separated by spaces, each of the list's item type
    cfg, _ = arm_config(AdversaryConfig(), Args(), dict(parse_arm("ng:disc_weights=1.0 0.5,d_steps=2")[1]))
    assert cfg.disc_weights == [1.0, 0.5] and cfg.d_steps == 2
    with pytest.raises(ConfigError, match="disc_weights"):
        arm_config(AdversaryConfig(), Args(), {"disc_weights": "1.0 x"})
    for bad in ({"nope": "1"}, {"objective": "ppo"}):
        with pytest.raises(ConfigError):
            arm_config(AdversaryConfig(), Args(), bad)
    with pytest.raises(ConfigError, match="key=value"):
        parse_arm("x:dpo_beta")


def test_study_smoke(tmp_path):
    """The warm start with its plateau curve, two arms at equal wall time (DPO rounds, SFT; GRPO left the study's arms
    and is run end to end by tests/test_adversary_e2e.py), the temperature chosen on validation contexts, every arm
    scored on the same test contexts."""
    out = tmp_path / "study"
    cmd = [sys.executable, "-m", "adversary.study", "--config", str(ROOT / "configs" / "smoke.yaml"), "--out", str(out),
           "--arms", "dpo:objective=dpo_rounds,round_chosen=real,round_contexts=8,dpo_batch_size=4,dpo_micro_batch=2",
           "sft", "sft_guided:guidance=3", "--guide_seconds", "3", "--guide_contexts", "64",
           "--arm_seconds", "6", "--study_contexts", "24", "--val_contexts", "24", "--temperatures", "0.8", "1.0",
           "--study_detectors", "classical", "style", "--study_folds", "3", "--n_boot", "100", "--plateau_steps", "4",
           "--plateau_eval_every", "2", "--study_seeds", "3001", "3002"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    study = json.loads((out / "study.json").read_text())
    assert set(study["arms"]) == {"warmstart", "dpo", "sft", "sft_guided"}
    assert [p["step"] for p in study["plateau"]] == [2, 4] and all(p["val_ppl"] > 1 for p in study["plateau"])
    for arm in ("dpo", "sft"):
        a = study["arms"][arm]
        # a rounds arm does not start a round it cannot finish in what is left (less than half the last one's time)
        assert a["steps"] >= 1 and (3 if arm == "dpo" else 6) <= a["train_wall_seconds"] < 60, \
            (arm, a["steps"], a["train_wall_seconds"])
    # the guided arm: SFT for 6 - 3 s, then its guide fitted on its own turns inside the arm's time, and every turn
    # it writes kept from 3 candidates
    g = study["arms"]["sft_guided"]
    assert g["guide"]["k"] == 3 and g["guide"]["train_seconds"] < g["train_wall_seconds"]
    assert g["guide"]["report"]["fit_items"] + g["guide"]["report"]["calibration_items"] == 2 * 64
    assert (out / "runs" / "sft_guided" / "guide" / "guide.json").exists()
    assert all(1 <= r["guide_ess"] <= 3 for r in g["per_seed"]) and study["arms"]["sft"].get("guide") is None
    for arm in ("dpo", "sft", "warmstart", "sft_guided"):
        a = study["arms"][arm]
        assert 0 <= a["td_ci95"][0] <= a["td"] <= a["td_ci95"][1] <= 50
        assert a["temperature"] in (0.8, 1.0) and set(a["val_td_by_temperature"]) == {"0.8", "1.0"}
        assert "len_ratio_median" in a["diagnostics"]
        assert [r["seed"] for r in a["per_seed"]] == [3001, 3002]
        assert a["td"] == pytest.approx(np.mean([r["td"] for r in a["per_seed"]]))
        for name in (f"{arm}.jsonl", f"{arm}.seed3002.jsonl"):  # every seed's turns, for re-scoring
            assert len((out / "arms" / name).read_text().splitlines()) == 24
    real_ids = [json.loads(x)["id"] for x in (out / "real.jsonl").read_text().splitlines()]
    assert [json.loads(x)["id"] for x in (out / "arms" / "sft.jsonl").read_text().splitlines()] == real_ids
    assert len(study["differences"]["dpo-sft"]["ci95"]) == 2
    assert study["conversation_differences"] == {}  # no conversation level asked for: no pair to compare
    assert (out / "study.png").stat().st_size > 5000
    # a rerun reuses every trained and scored arm (the same table, nothing trained or scored again) and, asked for
    # the conversation level, adds it to each arm
    r = subprocess.run(cmd + ["--study_conversations", "20", "--end_decision", "calibrated", "--conv_max_turns", "2"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("reusing its scoring") == 4 and "training for" not in r.stdout
    again = json.loads((out / "study.json").read_text())
    assert again["differences"] == study["differences"]
    for arm in ("dpo", "sft", "warmstart", "sft_guided"):
        conv = again["arms"][arm]["conversation"]
        assert 0 <= conv["conv/td"] <= 50 and [s["seed"] for s in conv["per_seed"]] == [3001, 3002]
        assert conv["conv/conversations"] == 20
        assert conv["guide_k"] == (3 if arm == "sft_guided" else 1)  # the guided arm's conversations are guided too
        assert isinstance(conv["end_bias"], float) and 0 <= conv["conv/termination_f1"] <= 1  # the calibrated decision
    # the conversation level's paired differences: every pair of arms, resampling the same held-out conversations
    cd = again["conversation_differences"]
    assert len(cd) == 6 and set(cd) == set(again["differences"])
    for k, d in cd.items():
        a, b = k.split("-")
        assert d["td_difference"] == pytest.approx(again["arms"][a]["conversation"]["conv/td"]
                                                   - again["arms"][b]["conversation"]["conv/td"])
        assert d["ci95"][0] <= d["ci95"][1] and 0 <= d["share_of_resamples_a_lower"] <= 1
    assert "oof" not in again["arms"]["sft"]["conversation"]  # the detectors' records stay in the arm's cache
    assert len(json.loads((out / "arms" / "sft.conv.json").read_text())["oof"]) == 2  # one per seed
