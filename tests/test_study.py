"""The controlled study end to end with tiny models: every arm trains the same number of steps from one warm start,
is scored on the same held-out contexts, and the paired differences come with CIs."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

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


def test_study_smoke(tmp_path):
    out = tmp_path / "study"
    cmd = [sys.executable, "-m", "adversary.study", "--config", str(ROOT / "configs" / "smoke.yaml"), "--out", str(out),
           "--arms", "adversarial", "sft", "--study_contexts", "24", "--study_detectors", "classical", "style",
           "--study_folds", "3", "--n_boot", "100", "--max_steps", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    study = json.loads((out / "study.json").read_text())
    assert set(study["arms"]) == {"warmstart", "adversarial", "sft"}
    assert study["arms"]["adversarial"]["steps"] == study["arms"]["sft"]["steps"] == 2
    for arm in ("adversarial", "sft", "warmstart"):
        a = study["arms"][arm]
        assert 0 <= a["td_ci95"][0] <= a["td"] <= a["td_ci95"][1] <= 50
        assert "len_ratio_median" in a["diagnostics"]
        lines = (out / "arms" / f"{arm}.jsonl").read_text().splitlines()
        assert len(lines) == 24
    real_ids = [json.loads(x)["id"] for x in (out / "real.jsonl").read_text().splitlines()]
    assert [json.loads(x)["id"] for x in (out / "arms" / "sft.jsonl").read_text().splitlines()] == real_ids
    assert "adversarial-sft" in study["differences"] and len(study["differences"]["adversarial-sft"]["ci95"]) == 2
    assert (out / "study.png").stat().st_size > 5000
