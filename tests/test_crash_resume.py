"""Crash and resume: SIGKILL the main job during generation, a discriminator update, a checkpoint save and the
export, resuming each time. Every resumed run finishes, the curve has neither gaps nor duplicate rows, the run state
is the saved one, and the final export verifies (an interrupted export never does)."""

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from adversary.export import verify_export

ROOT = Path(__file__).resolve().parent.parent
BASE_ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
SMALL = ["--max_steps", "3", "--eval_steps", "1", "--save_steps", "1", "--heldout_contexts", "20",
         "--train_contexts", "16", "--warmstart_steps", "1",
         "--disc_acc_ceiling", "1.0"]  # never skip a discriminator update, so the update kill point is reached


def run(out, crash=None, resume=False):
    env = dict(BASE_ENV)
    env.pop("MIMESIS_CRASH_AT", None)
    if crash:
        env["MIMESIS_CRASH_AT"] = crash
    cmd = [sys.executable, str(ROOT / "adversary" / "train.py"), "--config", str(ROOT / "configs" / "smoke.yaml"),
           "--output_dir", str(out), *SMALL]
    if resume:
        cmd += ["--resume_from_checkpoint", "latest"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)


def steps(out):
    with open(out / "curves.csv") as f:
        return [int(r["step"]) for r in csv.DictReader(f)]


@pytest.mark.slow
def test_sigkill_at_each_stage_then_resume(tmp_path):
    out = tmp_path / "run"
    # 1. killed in the first discriminator update of step 2 (by step: the guard rails make the count per step vary)
    r = run(out, crash="disc_update@2")
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert (out / "checkpoint-1" / "mimesis_state" / "COMPLETE").exists()
    # 2. resumed, then killed while simulating the held-out turns of the next evaluation
    r = run(out, crash="generation:1", resume=True)
    assert r.returncode == -signal.SIGKILL and "resuming from" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    # 3. resumed, then killed in the middle of writing a checkpoint's run state
    r = run(out, crash="save:1", resume=True)
    assert r.returncode == -signal.SIGKILL, r.stdout[-2000:] + r.stderr[-2000:]
    broken = [p for p in out.glob("checkpoint-*") if not (p / "mimesis_state" / "COMPLETE").exists()]
    assert broken, "the kill during the save should have left one incomplete checkpoint"
    # 4. resumed from the previous complete checkpoint, then killed during the export
    r = run(out, crash="export:1", resume=True)
    assert r.returncode == -signal.SIGKILL, r.stdout[-2000:] + r.stderr[-2000:]
    partial = list(out.glob(".frozen.partial-*"))
    assert partial, "the kill during the export should have left its temporary folder"
    assert all(verify_export(p) for p in [out / "frozen", *partial])  # nothing that passes verify
    # 5. resumed to the end
    r = run(out, resume=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert steps(out) == [0, 1, 2, 3]
    assert verify_export(out / "frozen") == []
    manifest = json.loads((out / "frozen" / "simulator.json").read_text())
    assert [row["step"] for row in manifest["td_curve"]] == [0, 1, 2, 3]
    last = max(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    state = json.loads((last / "mimesis_state" / "state.json").read_text())
    assert state["gate"]["readings"][-1]["step"] == int(last.name.split("-")[1])
