"""Evaluation matrix, resume from the episode cache, the controlled comparison and its statistics."""

import csv
import json
from pathlib import Path

import pytest

from agent_rl import stats
from agent_rl.compare import compare_records
from agent_rl.compare import main as compare_main
from agent_rl.evaluate import EPISODES_FILE, read_episodes
from agent_rl.evaluate import main as evaluate_main


pytestmark = pytest.mark.usefixtures("one_thread")


def _matrix(out: Path):
    with open(out / "matrix.csv") as f:
        return {(r["gym"], r["simulator"]): r for r in csv.DictReader(f)}


def test_evaluate_writes_a_matrix_and_resumes(tmp_path, capsys):
    out = tmp_path / "eval"
    argv = ["--agent", "scripted:oracle", "--simulators", "scripted:oracle", "scripted:terse",
            "--gyms", "intention,function,persuade", "--episodes", "3", "--out", str(out)]
    assert evaluate_main(argv) == 0
    m = _matrix(out)
    assert len(m) == (3 + 1) * 2  # (gyms + overall) x simulators
    assert float(m[("intention", "scripted:oracle")]["mean"]) == pytest.approx(210.0)
    assert float(m[("function", "scripted:terse")]["mean"]) == pytest.approx(100.0)
    assert int(m[("overall", "scripted:oracle")]["n"]) == 9
    overall = float(m[("overall", "scripted:oracle")]["mean"])
    per_gym = [float(m[(g, "scripted:oracle")]["mean"]) for g in ("intention", "function", "persuade")]
    assert overall == pytest.approx(sum(per_gym) / 3)
    md = (out / "matrix.md").read_text()
    assert "| intention |" in md and "**overall**" in md and "[" in md
    assert (out / "heatmap.png").stat().st_size > 1000
    cache = out / EPISODES_FILE
    lines = cache.read_text().splitlines()
    assert len(lines) == 18 and len({json.loads(x)["key"] for x in lines}) == 18
    # a rerun runs nothing; an interrupted one (last episodes lost, a torn line) runs only what is missing
    assert evaluate_main(argv) == 0
    assert len(cache.read_text().splitlines()) == 18
    cache.write_text("\n".join(lines[:-2]) + "\n" + lines[-1][:20])
    assert len(read_episodes(cache)) == 16
    assert evaluate_main(argv) == 0
    assert len(read_episodes(cache)) == 18
    assert _matrix(out) == m
    # other settings are other episodes: the cache key holds their fingerprint
    assert evaluate_main(argv + ["--max_turns", "1"]) == 0
    assert len(read_episodes(cache)) == 36
    assert float(_matrix(out)[("intention", "scripted:oracle")]["mean"]) == pytest.approx(100.0)
    # --first_seed: fresh episodes (seeds 5, 6), none taken from the cache of seed 0
    assert evaluate_main(argv + ["--first_seed", "5", "--repeats", "2"]) == 0
    fresh = read_episodes(cache)[36:]
    assert len(fresh) == 36 and {r["key"].split("|")[4] for r in fresh} == {"5", "6"}  # 2 seeds x 9 tasks x 2 users


def test_evaluate_an_hf_agent(tmp_path, tiny_lm_path):
    out = tmp_path / "hf"
    argv = ["--agent", f"hf:{tiny_lm_path}", "--simulators", "scripted:oracle", "--gyms", "telepathy,travel",
            "--episodes", "1", "--max_turns", "2", "--agent_max_new_tokens", "4", "--out", str(out)]
    assert evaluate_main(argv) == 0
    m = _matrix(out)
    assert set(m) == {("telepathy", "scripted:oracle"), ("travel", "scripted:oracle"), ("overall", "scripted:oracle")}
    eps = read_episodes(out / EPISODES_FILE)
    assert len(eps) == 2 and all(1 <= e["turns"] <= 2 for e in eps)


def test_compare_oracle_against_random(tmp_path):
    out = tmp_path / "cmp"
    argv = ["--agents", "scripted:random", "scripted:oracle", "--simulators", "scripted:oracle", "scripted:terse",
            "--gyms", "intention,telepathy", "--episodes", "4", "--out", str(out)]
    assert compare_main(argv) == 0
    res = json.loads((out / "compare.json").read_text())
    assert res["improved"] == 2 and res["improved_significantly"] == 2 and res["simulators"] == 2
    overall = [r for r in res["rows"] if r["gym"] == "overall"]
    for r in overall:
        assert r["delta"] == pytest.approx(r["score_b"] - r["score_a"]) and r["ci_low"] > 0
    assert "B improved on 2 of 2 simulators" in (out / "compare.md").read_text()
    for p in ("matrix_A.csv", "matrix_B.md", "compare.csv"):
        assert (out / p).exists()
    with pytest.raises(SystemExit):
        compare_main(["--agents", "scripted:random", "--out", str(out)])


def test_paired_statistics_exact():
    assert stats.mean_ci([0.5, 0.5, 0.5]) == (50.0, 50.0, 50.0)
    m, lo, hi = stats.mean_ci([0.0, 1.0] * 10)
    assert m == 50.0 and lo < 50 < hi
    assert stats.overall_ci({"a": [1.0, 1.0], "b": [0.0, 0.0, 0.0]})[0] == pytest.approx(50.0)
    # the same returns for both agents: delta exactly 0 with a zero-width interval
    same = {"g": ([0.1, 0.9, 0.4], [0.1, 0.9, 0.4])}
    assert stats.paired_delta_ci(same) == (0.0, 0.0, 0.0)
    # a constant improvement of 0.2 on every task: +20 with a zero-width interval, however spread the tasks are
    shifted = {"g": ([0.0, 0.5, 1.0, 0.3], [0.2, 0.7, 1.2, 0.5])}
    d, lo, hi = stats.paired_delta_ci(shifted)
    assert (d, lo, hi) == pytest.approx((20.0, 20.0, 20.0))
    recs_a = [{"simulator": "s", "gym": "g", "task_id": f"t{i}", "seed": 0, "return": v} for i, v in enumerate([0, 1])]
    recs_b = [dict(r, **{"return": r["return"] + 0.5}) for r in recs_a] + [
        {"simulator": "s", "gym": "g", "task_id": "extra", "seed": 0, "return": 9.0}]  # unpaired: ignored
    res = compare_records(recs_a, recs_b, ["g"], ["s"])
    assert res["rows"][-1]["delta"] == pytest.approx(50.0) and res["rows"][-1]["n"] == 2


def test_report_scores_every_agent_and_compares_the_pair(tmp_path):
    from agent_rl.report import main as report_main

    out = tmp_path / "rep"
    argv = ["--agents", "random=scripted:random", "oracle=scripted:oracle", "--pair", "random", "oracle",
            "--reference", "scripted:oracle", "--simulators", "scripted:terse", "--gyms", "intention,travel",
            "--episodes", "3", "--repeats", "2", "--pair_repeats", "1", "--out", str(out),
            "--json", str(tmp_path / "agents.json")]
    assert report_main(argv) == 0
    res = json.loads((tmp_path / "agents.json").read_text())
    rand, orac = res["agents"]["random"], res["agents"]["oracle"]
    assert rand["n"] == orac["n"] == 12 and rand["deltas"] == {}  # 2 gyms x 3 tasks x 2 repeats
    d = orac["deltas"]["random"]
    # every task paired: the delta is the difference of the two overall scores, and the oracle solves what random cannot
    assert d["delta"] == pytest.approx(orac["score"] - rand["score"]) and d["ci_low"] > 0 and d["n"] == 12
    assert orac["by_gym"]["travel"]["n"] == 6
    cmp = res["comparison"]
    assert cmp["a"] == "random" and cmp["b"] == "oracle" and cmp["improved"] == 1
    assert cmp["episodes_per_agent_and_simulator"] == {"scripted:terse": 6} and cmp["repeats"] == 1  # --pair_repeats
    assert "oracle improved on 1 of 1 simulators" in (out / "report.md").read_text()
    # a rerun plays nothing new: every episode comes from the cache
    lines = (out / EPISODES_FILE).read_text().splitlines()
    assert report_main(argv) == 0 and (out / EPISODES_FILE).read_text().splitlines() == lines
    with pytest.raises(SystemExit):
        report_main(["--agents", "scripted:random", "--out", str(out)])
    with pytest.raises(SystemExit):
        report_main(["--agents", "a=scripted:random", "--pair", "a", "b", "--out", str(out)])
