"""`python -m discriminator.evaluate`: end to end, and bad input as one line on stderr."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conversations import write_jsonl
from discriminator.controls import real_halves, templated
from discriminator.evaluate import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("td")
    real, _ = real_halves(40, seed=8)
    sim = templated(real)
    # real side as conversations (messages format: every user turn becomes an item), simulated as turn records
    write_jsonl(d / "real.jsonl", [{"id": r.id, "messages": r.context + [{"role": "user", "content": r.user_turn}]}
                                   for r in real])
    write_jsonl(d / "sim.jsonl", sim)
    return d


def test_cli_end_to_end(files, capsys):
    out = files / "report.json"
    rc = main(["--real", str(files / "real.jsonl"), "--simulated", str(files / "sim.jsonl"),
               "--detectors", "classical,style", "--folds", "3", "--n-boot", "100", "--out", str(out), "--quiet"])
    assert rc == 0
    report = json.loads(out.read_text())
    for key in ("td", "td_ci95", "signed", "auc", "n_real", "n_simulated", "detectors"):
        assert key in report
    assert len(report["td_ci95"]) == 2
    assert report["n_real"] == report["n_simulated"]  # the larger (real) side was sampled down
    assert report["n_real_input"] > report["n_real"]
    assert set(report["detectors"]) == {"classical", "style"}
    assert set(report["detectors"]["style"]) >= {"accuracy", "auc", "td"}
    assert report["td"] > 30
    shown = capsys.readouterr().out
    assert "Turing distance" in shown and "classical" in shown and "style" in shown


def test_cli_subprocess_bad_line(files, tmp_path):
    bad = tmp_path / "bad.jsonl"
    lines = (files / "sim.jsonl").read_text().splitlines()
    lines[4] = '{"id": "x", "context": [], "user_turn": '  # truncated JSON on line 5
    bad.write_text("\n".join(lines) + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "-m", "discriminator.evaluate", "--real", str(files / "real.jsonl"), "--simulated", str(bad),
         "--detectors", "style", "--out", str(tmp_path / "r.json")],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )
    assert p.returncode == 2
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "bad.jsonl:5" in err[0] and "Traceback" not in p.stderr
    assert not (tmp_path / "r.json").exists()


def test_cli_too_few_items(files, tmp_path, capsys):
    small = tmp_path / "small.jsonl"
    small.write_text("\n".join((files / "sim.jsonl").read_text().splitlines()[:19]) + "\n")
    with pytest.raises(SystemExit) as e:
        main(["--real", str(files / "real.jsonl"), "--simulated", str(small), "--out", str(tmp_path / "r.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "small.jsonl" in err[0] and "at least 20" in err[0]


def test_cli_unknown_detector(files, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--real", str(files / "real.jsonl"), "--simulated", str(files / "sim.jsonl"), "--detectors", "oracle",
              "--out", str(tmp_path / "r.json")])
    assert e.value.code == 2
    assert "unknown detector 'oracle'" in capsys.readouterr().err
