"""Every entry point answers a wrong value with one line naming the key (or the name), a non-zero exit and no
traceback. Table-driven: the cases the issue names, a bad model name for every entry point that takes one, and a bad
value of every numeric field with a natural range (derived from the declared ranges, so a new field is covered the
moment it gets one). The CLIs' `main(argv)` run in-process (imports paid once); a few run as real processes too."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SMOKE = str(ROOT / "configs" / "smoke.yaml")
AGENT_SMOKE = str(ROOT / "configs" / "agent_smoke.yaml")


def bad_value(spec: str):
    """A value outside a range spec of `conversations.config.check_ranges`."""
    spec = spec.split(" or ")[-1].strip()
    if spec[0] in "[(":
        lo, hi = (float(x) for x in spec[1:-1].split(","))
        return hi + 1 if spec[-1] == "]" else hi
    op, b = re.match(r"(>=|<=|>|<)\s*(-?[\d.]+)", spec).groups()
    b = float(b)
    return {">=": b - 1, ">": b, "<=": b + 1, "<": b}[op]


def _fmt(v):
    return str(int(v)) if float(v).is_integer() else str(v)


def _entry(name):
    if name == "train":
        from adversary.train import main
    elif name == "study":
        from adversary.study import main
    elif name == "sft":
        from generator.sft import main
    elif name == "simulate":
        from generator.simulate import main
    elif name == "agent_train":
        from agent_rl.train import main
    elif name == "agent_evaluate":
        from agent_rl.evaluate import main
    elif name == "serve":
        from agent_rl.serve import main
    elif name == "evaluate":
        from discriminator.evaluate import main
    return main


def _cases():
    from adversary.config import RANGES
    from generator.sft import SFT_RANGES

    cases = [
        # the issue's own cases
        ("train", ["--config", SMOKE, "--learning_rate", "-1"], "learning_rate"),
        ("train", ["--config", SMOKE, "--max_steps", "-3"], "max_steps"),
        ("train", ["--config", SMOKE, "--fp16", "true"], "fp16"),
        ("train", ["--config", SMOKE, "--dtype", "fp64"], "dtype"),
        ("train", ["--config", SMOKE, "--model", "no-such-org/no-such-model"], "no-such-org/no-such-model"),
        ("train", ["--config", SMOKE, "--model", "./no/such/folder"], "./no/such/folder"),
        ("train", ["--config", SMOKE, "--discriminator", "no-such-encoder"], "no-such-encoder"),
        ("train", ["--config", SMOKE, "--objective", "ppo"], "objective"),
        ("train", ["--config", SMOKE, "--grpo_rollout", "vllm"], "grpo_rollout"),
        ("train", ["--config", SMOKE, "--num_generations", "1"], "num_generations"),
        ("train", ["--config", SMOKE, "--temperature", "0"], "temperature"),
        ("train", ["--config", SMOKE, "--per_device_train_batch_size", "0"], "per_device_train_batch_size"),
        ("train", ["--config", SMOKE, "--eval_steps", "0"], "eval_steps"),
        ("sft", ["--model", "no-such-org/no-such-model"], "no-such-org/no-such-model"),
        ("sft", ["--max_length", "100", "--max_context_tokens", "120"], "max_length"),
        ("simulate", ["--model", "no-such-org/no-such-model"], "no-such-org/no-such-model"),
        ("simulate", ["--model", "tiny-random", "--split", "nope"], "--split"),
        ("simulate", ["--model", "tiny-random", "--limit", "0"], "limit"),
        ("simulate", ["--model", "tiny-random", "--top_p", "0"], "top_p"),
        ("agent_train", ["--config", AGENT_SMOKE, "--agent_model", "no-such-org/no-such-model"], "no-such-org/no-such-model"),
        ("agent_train", ["--config", AGENT_SMOKE, "--simulator", "hf:no-such-org/no-such-model"], "no-such-org/no-such-model"),
        ("agent_train", ["--config", AGENT_SMOKE, "--simulator", "frozen:/no/such/export"], "/no/such/export"),
        ("agent_train", ["--config", AGENT_SMOKE, "--learning_rate", "-1"], "learning_rate"),
        ("agent_train", ["--config", AGENT_SMOKE, "--max_steps", "-3"], "max_steps"),
        ("agent_train", ["--config", AGENT_SMOKE, "--gamma", "0"], "gamma"),
        ("agent_evaluate", ["--agent", "hf:no-such-org/no-such-model", "--episodes", "1"], "no-such-org/no-such-model"),
        ("agent_evaluate", ["--simulators", "hf:no-such-org/no-such-model"], "no-such-org/no-such-model"),
        ("agent_evaluate", ["--simulators", "nope:x"], "nope:x"),
        ("agent_evaluate", ["--repeats", "0"], "repeats"),
        ("serve", ["hf:no-such-org/no-such-model"], "no-such-org/no-such-model"),
        ("serve", ["/no/such/export"], "/no/such/export"),
        ("serve", ["hf:tiny-random", "--max-new-tokens", "0"], "--max-new-tokens"),
        ("serve", ["hf:tiny-random", "--judge-upstream", "openai:j@http://127.0.0.1:9/v1"], "--judge-upstream"),
        ("serve", ["hf:tiny-random", "--userrl", "--judge-upstream", "judge-model"], "--judge-upstream"),
        ("study", ["--config", SMOKE, "--arm_seconds", "0"], "arm_seconds"),
        ("study", ["--config", SMOKE, "--arms", "x:no_such_key=1"], "no_such_key"),
        ("study", ["--config", SMOKE, "--temperatures", "-1"], "temperatures"),
        ("evaluate", ["--real", "a.jsonl", "--simulated", "b.jsonl", "--out", "r.json", "--folds", "1"], "--folds"),
        ("evaluate", ["--real", "a.jsonl", "--simulated", "b.jsonl", "--out", "r.json", "--backbone", "no-such-org/x"],
         "no-such-org/x"),
    ]
    for key, spec in RANGES.items():  # every numeric field of the main job
        cases.append(("train", ["--config", SMOKE, f"--{key}", _fmt(bad_value(spec))], key))
    for key, spec in SFT_RANGES.items():
        cases.append(("sft", ["--model", "tiny-random", f"--{key}", _fmt(bad_value(spec))], key))
    return cases


CASES = _cases()


@pytest.mark.parametrize("entry,argv,names", CASES, ids=[f"{c[0]}:{' '.join(c[1][-2:])}" for c in CASES])
def test_bad_value_is_one_clear_line(entry, argv, names, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # an unknown hub id must not be looked up on the network
    monkeypatch.chdir(ROOT)
    main = _entry(entry)
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code not in (0, None), err
    assert names in err and err.startswith("error:"), err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err


def test_bad_values_as_real_processes():
    """The issue's cases as a user runs them: exit 2, one line on stderr, no traceback, nothing exported."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    for argv, names in ((["adversary/train.py", "--config", SMOKE, "--learning_rate", "-1"], "learning_rate"),
                        (["adversary/train.py", "--config", SMOKE, "--max_steps", "-3"], "max_steps"),
                        (["-m", "generator.simulate", "--model", "no-such-org/no-such-model"], "no-such-org")):
        r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
        err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.returncode == 2 and len(err) == 1 and names in err[0], r.stderr[-2000:]
        assert "Traceback" not in r.stderr


def test_bf16_on_a_cpu_is_a_precision_not_an_error():
    """`--bf16 true` on a machine without a GPU: the run's precision (use_cpu is the default there), the same for
    every stage; `--fp16 true` is refused above."""
    from adversary.train import parse_args

    cfg, args = parse_args(["--config", SMOKE, "--bf16", "true"])
    assert cfg.dtype == "bf16" and args.bf16 and args.mixed_precision == "bf16" and args.use_cpu
