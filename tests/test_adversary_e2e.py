"""The main job end to end with the smoke preset: curves, plot, export, verify, resume, two processes."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def launch(out, *extra, processes=1, timeout=600):
    # cpu2.yaml: torchrun starts the two processes, each forms a gloo group on the CPU (see the note in the file:
    # `--cpu --num_processes 2` alone starts one process in accelerate 1.x)
    preset = ROOT / "configs" / "accelerate" / ("cpu.yaml" if processes == 1 else "cpu2.yaml")
    cmd = ["accelerate", "launch", "--config_file", str(preset),
           str(ROOT / "adversary" / "train.py"), "--config", str(ROOT / "configs" / "smoke.yaml"),
           "--output_dir", str(out), *extra]
    env = {**ENV, "ACCELERATE_USE_CPU": "true"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def curve_steps(out):
    with open(out / "curves.csv") as f:
        return [int(r["step"]) for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    r = launch(out, "--eval_base_model", "true", "--export_guidance", "3", "--export_guide_contexts", "64")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, r


def test_smoke_outputs(smoke_run):
    out, r = smoke_run
    assert "done: td (95% CI) base " in r.stdout
    assert curve_steps(out) == [0, 2, 4]
    assert (out / "turing_curve.png").stat().st_size > 5000
    summary = json.loads((out / "summary.json").read_text())
    assert summary["gate"] in ("plateau", "target", "max_steps") and 0 <= summary["best_td"] <= 50
    assert 0 <= summary["base_model_td"] <= 50  # the un-tuned base model, scored on the same held-out contexts
    manifest = json.loads((out / "frozen" / "simulator.json").read_text())
    assert manifest["config"]["adversary"]["model"]["model"] == "tiny-random"
    assert len(manifest["td_curve"]) == 3 and manifest["gate"]["reason"] == summary["gate"]
    assert manifest["base_model_td"]["td/panel"] == pytest.approx(summary["base_model_td"], abs=0.01)
    assert "model.safetensors" in manifest["files"] and manifest["prompt_format_version"]
    v = subprocess.run([sys.executable, "-m", "adversary.export", "verify", str(out / "frozen")], capture_output=True, text=True)
    assert v.returncode == 0, v.stderr
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "frozen")
    # the export's guide: fitted on the exported simulator's own turns, hashed with the rest, used by its users
    g = manifest["guidance"]
    assert (g["k"], g["rule"], g["members"], g["fit_items"] > 0) == (3, "resample", ["classical"], True)
    assert any(f.startswith("guide/") for f in manifest["files"]) and "export guide: K=3" in r.stdout
    from agent_rl.users import load_simulator

    assert load_simulator(f"frozen:{out / 'frozen'}").guide.k == 3
    assert load_simulator(f"frozen:{out / 'frozen'}#guidance=1").guide is None
    # the best checkpoint, not the last, is exported
    best = json.loads((out / "best" / "best.json").read_text())
    assert manifest["best"]["step"] == best["step"] and manifest["best"]["td"] == min(r["td/panel"] for r in manifest["td_curve"])


def test_resume_continues_without_duplicate_rows(smoke_run, tmp_path):
    import shutil

    out, _ = smoke_run
    # pretend the run stopped after checkpoint 2: keep its state, drop what came later
    run = tmp_path / "run"
    shutil.copytree(out, run, symlinks=True)
    shutil.rmtree(run / "checkpoint-4")
    shutil.rmtree(run / "frozen", ignore_errors=True)
    state = json.loads((run / "checkpoint-2" / "mimesis_state" / "state.json").read_text())
    assert [r["step"] for r in state["rows"]] == [0, 2]
    from adversary.config import PARTS

    assert list(state["config"]) == list(PARTS) and state["config"]["model"]["model"] == "tiny-random"
    r = launch(run, "--resume_from_checkpoint", "latest")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resuming from" in r.stdout and "discriminator: initial fit" not in r.stdout
    assert curve_steps(run) == [0, 2, 4]
    assert subprocess.run([sys.executable, "-m", "adversary.export", "verify", str(run / "frozen")]).returncode == 0


def test_bad_config_key_is_one_clear_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "configs" / "smoke.yaml").read_text() + "\nlearning_rat: 0.1\n")
    r = subprocess.run([sys.executable, str(ROOT / "adversary" / "train.py"), "--config", str(bad)],
                       capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 2
    assert "unknown key 'learning_rat'" in r.stderr and "did you mean 'learning_rate'" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message a machine without a GPU gets")
def test_use_vllm_without_vllm_or_gpu_is_one_clear_line():
    r = subprocess.run([sys.executable, str(ROOT / "adversary" / "train.py"), "--config", str(ROOT / "configs" / "smoke.yaml"),
                        "--use_vllm", "true"], capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 2
    assert "use_vllm: true" in r.stderr and "no GPU is visible" in r.stderr and "--use_vllm false" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.distributed
def test_two_processes_keep_discriminator_identical(tmp_path):
    out = tmp_path / "ddp"
    r = launch(out, "--max_steps", "2", "--eval_steps", "2", "--save_steps", "2", processes=2)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "discriminator identical on 2 ranks: yes" in r.stdout


def _curve_rows(path):
    """curves.csv without its timing columns (seconds vary run to run; every other value is fixed by the seed)."""
    with open(path) as f:
        return [{k: v for k, v in row.items() if not k.endswith("seconds")} for row in csv.DictReader(f)]


def test_smoke_curve_rows_are_pinned(smoke_run):
    """The same seed gives the same curve rows: the smoke run's curves.csv (every column but the timings) equals the
    one pinned in tests/data/smoke_curves.csv, written by this code before the refactors that followed it (the run
    state object, the data object, the library calls). A change that moves a row is a behaviour change: say so, and
    re-pin with `python tests/data/pin_smoke_curves.py`."""
    out, _ = smoke_run
    pinned_on = json.loads((ROOT / "tests" / "data" / "smoke_curves.cpu.json").read_text())
    if pinned_on != pin_fingerprint():
        # fp32 kernels differ between CPU families (AVX-512 vs AVX2, AMX): a sampled token moves and every row after
        pytest.skip(f"curves pinned on another CPU/torch ({pinned_on}); re-pin there with tests/data/pin_smoke_curves.py")
    pinned = _curve_rows(ROOT / "tests" / "data" / "smoke_curves.csv")
    rows = _curve_rows(out / "curves.csv")
    # columns added since the pin (td/log_loss, td/seeds, td/seed_sd) are new readings, not moved ones
    assert all(set(p) <= set(r) for p, r in zip(pinned, rows))
    assert [{k: r[k] for k in p} for p, r in zip(pinned, rows)] == pinned and len(rows) == len(pinned)


def pin_fingerprint() -> dict:
    """What the pinned rows depend on besides the code: the CPU model, its vector extensions and torch's version."""
    from conversations.precision import _cpu_fingerprint

    fp = _cpu_fingerprint()
    return {"cpu": fp["cpu"], "flags": fp["flags"], "torch": fp["torch"]}


def test_the_run_reads_what_it_ships_and_writes_its_realism_report(smoke_run):
    out, r = smoke_run
    summary = json.loads((out / "summary.json").read_text())
    sims = summary["simulators"]
    assert set(sims) == {"base_model", "warm_start", "best", "shipped"}
    assert sims["shipped"]["guidance"] == 3 and 0 <= sims["shipped"]["td"] <= 50
    lo, hi = sims["shipped"]["td_ci95"]
    assert lo <= sims["shipped"]["td"] <= hi and summary["shipped_td"] == sims["shipped"]["td"]
    last = [line for line in r.stdout.splitlines() if line.startswith("done:")][-1]
    assert "shipped with its guide K=3" in last and "warm start" in last and "None" not in last
    card = (out / "frozen" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers")
    assert "**shipped export** (guide K=3)" in card and "## Its tells" in card
    assert card.count("\n| ") >= 10 + 4 + 5  # ten turns beside the real ones, four simulators, the tells
    best = json.loads((out / "frozen" / "simulator.json").read_text())["best"]
    assert f"best td {best['td']:.1f} at step {best['step']}." in card and "?" not in card.splitlines()[-1]
    assert (out / "frozen" / "lengths.png").stat().st_size > 5000
    # the report is part of the export: hashed, so verify still passes and a change to it is caught
    manifest = json.loads((out / "frozen" / "simulator.json").read_text())
    assert {"README.md", "lengths.png", "realism.json"} <= set(manifest["files"])
    v = subprocess.run([sys.executable, "-m", "adversary.export", "show", str(out / "frozen")], capture_output=True,
                       text=True)
    assert v.returncode == 0 and "How human it reads" in v.stdout
    assert "None" not in (out / "curves.csv").read_text().splitlines()[0]


def test_the_main_job_runs_on_the_second_model_family(tmp_path):
    """Any causal LM: the smoke job end to end on a tiny random Gemma 3 (the architecture, tokenizer and turn format of
    the `gemma3-270m` asset), and its export writes a user turn in Gemma's format."""
    out = tmp_path / "gemma"
    r = launch(out, "--model", "tiny-random-gemma3", "--max_steps", "2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "done: td (95% CI) base " in r.stdout and "None" not in r.stdout.splitlines()[-1]
    frozen = out / "frozen"
    assert json.loads((frozen / "config.json").read_text())["model_type"] == "gemma3_text"
    assert "<start_of_turn>" in (frozen / "chat_template.jinja").read_text()
    assert "shipped_td" in json.loads((out / "summary.json").read_text()) and (frozen / "README.md").exists()
    from agent_rl.gyms import get_gym
    from agent_rl.gyms.base import UserRequest
    from agent_rl.users import load_simulator

    gym = get_gym("intention")
    task = gym.tasks("train")[0]
    request = UserRequest(context=[{"role": "user", "content": task.opening},
                                   {"role": "assistant", "content": "What is your budget?"}],
                          goal=gym.user_goal(task), gym="intention", task=task)
    turns = load_simulator(f"frozen:{frozen}#guidance=1").reply([request] * 4)
    assert len(turns) == 4 and not any(m in t for t in turns for m in ("<start_of_turn>", "<end_of_turn>", "<bos>"))
