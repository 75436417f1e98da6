"""The GPU paths, checked in one short run on one GPU machine (about 8 minutes with the embedded model).

    python bench/gpu_check.py                 # on the GPU machine; JSON summary to $OUT/gpu_check.json when $OUT is set
    python bench/gpu_check.py --dry-run       # on a CPU: every path parses its config and fails only for lack of a GPU

Each check runs with its own time limit and prints one line, `<name>: ok <figures>` or `<name>: failed <the error's
last line>`; a failed check does not stop the others. The checks:
- `install`: vLLM and DeepSpeed import (else installed from `.whl/` wheels carried to the machine, `pip install
  --no-index --find-links .whl`; the machine reaches no package index);
- `smoke_bf16`, `demo_bf16`: the main job's smoke and demo presets in bf16 on the GPU (the demo cut to a few steps);
  figures: GRPO step time, held-out generation seconds;
- `vllm_colocate`: the smoke preset with `use_vllm: true, vllm_mode: colocate`;
- `zero3`: the smoke preset under DeepSpeed ZeRO-3 in one process (configs/accelerate/zero3.yaml);
- `heldout`: a held-out evaluation of the embedded model (generator.simulate + discriminator.evaluate); figures:
  generation tokens/s;
- `agent_rl`: a short agent-RL run (configs/agent_smoke.yaml);
- `mfu`: LoRA forward + backward of SmolLM2 on the demo's shapes, timed; MFU = 6 x params x tokens/s / the GPU's bf16
  peak (`--peak_tflops`, 989 for an H100/H200 SXM, dense);
- `cuda_tests`: the unit tests that have a CUDA case (skipped on a CPU).
The GPU machine of a lease has no package index and carries at most 64 MiB: `python bench/gpu_pack.py pack` here
packs what it lacks (docs/scaling.md, "The GPU check").
In `--dry-run` (a CPU test keeps this script from rotting) each check parses every config it would launch with the
job's own parser and then stops with `failed no GPU is visible` (or the one line the job gives for a missing
engine); anything else is a real failure of the script, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
NO_GPU = "no GPU is visible"


def sh(cmd: list[str], timeout: float, env=None) -> tuple[int, str]:
    """(exit status, stdout + stderr) of a command run with a time limit (status 124 when it ran out)."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                           env={**os.environ, **(env or {}),
                                # the repository first, then whatever the caller put there (carried wheels)
                                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
        return r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out + f"\ntimed out after {timeout:.0f}s"


def last_line(text: str) -> str:
    lines = [x.strip() for x in text.strip().splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith(("error:", "Error", "RuntimeError", "ValueError", "ImportError",
                                                "ModuleNotFoundError", "torch.OutOfMemoryError", "timed out"))]
    return (errors or lines or ["(no output)"])[-1][:300]


def job(*argv: str, accelerate_config: str | None = None) -> list[str]:
    cfg = ["--config_file", str(ROOT / "configs" / "accelerate" / accelerate_config)] if accelerate_config else []
    # through the interpreter, not the `accelerate` script: the one that runs is the one on this Python's path
    return [sys.executable, "-m", "accelerate.commands.launch", *cfg, "--num_processes", "1",
            "--mixed_precision", "bf16", *argv]


def parse_main_job(argv: list[str]) -> None:
    from adversary.train import parse_args
    from generator.model import check_vllm

    cfg, args = parse_args(argv)
    check_vllm(args.use_vllm)


def parse_agent(argv: list[str]) -> None:
    from trl import GRPOConfig

    from agent_rl.train import AgentRLArgs
    from conversations.config import parse_config

    parse_config((AgentRLArgs, GRPOConfig), argv)


def install_dry() -> None:
    missing = [m for m in ("vllm", "deepspeed") if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not installed (the GPU machine gets them from carried .whl wheels)")
    need_gpu()


def need_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(NO_GPU)


def figures_from_log(text: str) -> dict:
    """GRPO step seconds (tqdm's s/it) and the held-out evaluation seconds the job printed."""
    out = {}
    steps = re.findall(r"([\d.]+)s/it", text)
    if steps:
        out["grpo_step_s"] = float(steps[-1])
    done = re.findall(r"done: .*?; ([\d.]+) min", text)
    if done:
        out["job_minutes"] = float(done[-1])
    return out


class Check:
    def __init__(self, name, limit, run, dry):
        self.name, self.limit, self.run, self.dry = name, limit, run, dry


def checks(a, out: Path) -> list[Check]:
    smoke = str(ROOT / "configs" / "smoke.yaml")
    demo = str(ROOT / "configs" / "demo.yaml")
    agent = str(ROOT / "configs" / "agent_smoke.yaml")

    def main_job(name, argv, accelerate_config=None, limit=120):
        def run():
            rc, text = sh(job(str(ROOT / "adversary" / "train.py"), *argv, "--output_dir", str(out / name),
                              accelerate_config=accelerate_config), limit)
            return rc, text, figures_from_log(text)

        def dry():
            if accelerate_config == "zero3.yaml" and importlib.util.find_spec("deepspeed") is None:
                parse_main_job(argv)
                raise RuntimeError("DeepSpeed is not installed (pip install -e '.[gpu]')")
            parse_main_job(argv)
            need_gpu()

        return Check(name, limit, run, dry)

    def install():
        missing = [m for m in ("vllm", "deepspeed") if importlib.util.find_spec(m) is None]
        if missing and (ROOT / ".whl").is_dir():
            sh([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(ROOT / ".whl"), *missing],
               240)
            missing = [m for m in missing if importlib.util.find_spec(m) is None]
        return (1 if missing else 0), f"missing: {missing}" if missing else "", {"missing": missing}

    def heldout():
        t0 = time.time()
        rc, text = sh([sys.executable, "-m", "generator.simulate", "--model", "smollm2-135m-instruct", "--limit", "256",
                       "--batch_size", "128", "--max_new_tokens", "96", "--out", str(out / "sim.jsonl"), "--real_out",
                       str(out / "real.jsonl")], 150)
        figs = {}
        if rc == 0:
            # the first JSON object printed (progress bars and warnings may follow it)
            report, _ = json.JSONDecoder().raw_decode(text[text.index("{"):])
            figs["turn_tokens_per_s"] = report.get("turn_tokens_per_s")
            rc, text2 = sh([sys.executable, "-m", "discriminator.evaluate", "--real", str(out / "real.jsonl"),
                            "--simulated", str(out / "sim.jsonl"), "--out", str(out / "report.json"), "--quiet"], 150)
            text += text2
            if rc == 0:
                figs["td"] = json.loads((out / "report.json").read_text())["td"]
        figs["seconds"] = round(time.time() - t0, 1)
        return rc, text, figs

    def heldout_dry():
        from generator.simulate import SimulateArgs

        SimulateArgs(model="smollm2-135m-instruct", limit=256, batch_size=128, max_new_tokens=96, out="x.jsonl")
        need_gpu()

    def agent_run():
        rc, text = sh(job(str(ROOT / "agent_rl" / "train.py"), "--config", agent, "--output_dir", str(out / "agent"),
                          "--dtype", "bf16"), 120)
        return rc, text, {}

    def mfu():
        rc, text = sh([sys.executable, __file__, "--mfu_worker", "--peak_tflops", str(a.peak_tflops)], 120)
        # the worker's figures are its last JSON line (loading bars and warnings share the stream)
        found = [line for line in text.splitlines() if line.startswith("{")]
        figs = json.loads(found[-1]) if rc == 0 and found else {}
        return (rc or (0 if found else 1)), text, figs

    def cuda_tests():
        # the unit tests with a CUDA case (skipped on a CPU)
        rc, text = sh([sys.executable, "-m", "pytest", "-q", "-rs", "-k", "cuda", "tests/test_generator_sample.py"],
                      180)
        return rc, text, {}

    return [
        Check("install", 300, install, install_dry),
        main_job("smoke_bf16", ["--config", smoke, "--dtype", "bf16"]),
        # random weights (bench/gpu_pack.py) write every turn to its token limit: 4 steps took over 240 s on an H200
        main_job("demo_bf16", ["--config", demo, "--dtype", "bf16", "--max_steps", "4",
                               "--heldout_contexts", "64"], limit=300),
        main_job("vllm_colocate", ["--config", smoke, "--dtype", "bf16", "--use_vllm", "true", "--vllm_mode", "colocate",
                                   "--vllm_gpu_memory_utilization", "0.3"], limit=240),
        main_job("zero3", ["--config", smoke, "--dtype", "bf16"], accelerate_config="zero3.yaml"),
        Check("heldout", 300, heldout, heldout_dry),
        Check("agent_rl", 120, agent_run, lambda: (parse_agent(["--config", agent, "--dtype", "bf16"]), need_gpu())),
        Check("mfu", 120, mfu, need_gpu),
        Check("cuda_tests", 180, cuda_tests, need_gpu),
    ]


def mfu_worker(peak_tflops: float) -> int:
    """LoRA forward + backward + AdamW of SmolLM2 on 16 x 256 tokens in bf16, 5 timed steps after 2 warm-ups."""
    import torch

    from generator.model import LoraSettings, load_generator

    model, _ = load_generator("smollm2-135m-instruct", lora=LoraSettings(r=16, alpha=32, dropout=0.0), device="cuda")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.randint(0, 40000, (16, 256), device="cuda")
    times = []
    for i in range(7):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    n = sum(p.numel() for p in model.parameters())
    tps = ids.numel() / (sum(times) / len(times))
    print(json.dumps({"tokens_per_s": round(tps), "mfu": round(6 * n * tps / (peak_tflops * 1e12), 4),
                      "params": n, "step_s": round(sum(times) / len(times), 4)}))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="on a CPU: parse every path's config, expect 'no GPU'")
    p.add_argument("--only", nargs="*", default=None, help="run these checks only, in this order")
    p.add_argument("--peak_tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (H100/H200 SXM: 989)")
    p.add_argument("--mfu_worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.mfu_worker:
        return mfu_worker(a.peak_tflops)
    # $OUT gets the summary and one log (a lease brings back 8 files); the checks' own outputs stay in a work folder
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu_check."))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_work."))
    log = open(out / "gpu_check.log", "w")
    summary, bad = {"dry_run": a.dry_run, "checks": {}}, 0
    todo = checks(a, work)
    if a.only:
        # in the order asked: a lease's call can run out, and what matters most goes first
        by_name = {c.name: c for c in todo}
        todo = [by_name[n] for n in a.only if n in by_name]
    for c in todo:
        t0 = time.time()
        if a.dry_run:
            try:
                c.dry()
                line, ok = "ok parsed (a GPU is visible: run without --dry-run)", True
            except Exception as e:  # noqa: BLE001 - each check reports its own failure
                msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                expected = NO_GPU in msg or "not installed" in msg
                line, ok = f"failed {msg}", expected
                bad += not expected
            summary["checks"][c.name] = {"status": "ok" if line.startswith("ok") else "failed", "line": line,
                                         "expected": ok}
        else:
            try:
                rc, text, figs = c.run()
            except Exception as e:  # noqa: BLE001 - a check that breaks is reported, the others still run
                rc, text, figs = 1, f"{type(e).__name__}: {e}", {}
            log.write(f"===== {c.name} (exit {rc})\n" + "\n".join(text.splitlines()[-150:]) + "\n")
            log.flush()
            status = "ok" if rc == 0 else "failed"
            line = f"ok {json.dumps(figs)}" if rc == 0 else f"failed {last_line(text)}"
            bad += rc != 0
            summary["checks"][c.name] = {"status": status, "line": line, "figures": figs,
                                         "seconds": round(time.time() - t0, 1)}
        print(f"{c.name}: {line}", flush=True)
        # after every check, so a call cut off at its limit still brings back what ran
        (out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
    log.close()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
