"""Meter cost and the default run's budget: runs the main job once, as a user would, and reports its wall time, peak
memory, the share of wall time spent on held-out td evaluation (the meter) and the td it reached.

    python bench/bench_default_run.py                              # configs/demo.yaml, 1 CPU process
    python bench/bench_default_run.py --config configs/smoke.yaml  # fast check of the benchmark itself
    python bench/bench_default_run.py -- --max_steps 10            # anything after -- goes to the main job

Targets (the embedded default on 2 CPU cores): wall time <= 15 min, peak RSS <= 6 GiB, meter share <= 15 %.

Where the numbers come from:
- `wall_seconds`: this script's clock around the whole launch (`accelerate launch` start-up, data, warm start,
  discriminator fit, adversarial phase, export); `job_wall_seconds` is the job's own clock from summary.json.
- `peak_rss_mb`: the largest resident set of any process of the run, from `/usr/bin/time -v` ("Maximum resident set
  size"; it covers the launcher's reaped children) when present, else `resource.getrusage(RUSAGE_CHILDREN)`.
- `meter_share`: from summary.json: seconds spent in held-out evaluation (simulating the held-out contexts and
  fitting the detector panel, every `eval_steps` and before the first step) over the job's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, emit, log, r  # noqa: E402

TARGETS = {"wall_seconds": 15 * 60, "peak_rss_mb": 6 * 1024, "meter_share": 0.15}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"), help="preset of the main job")
    p.add_argument("--accelerate_config", default=str(ROOT / "configs" / "accelerate" / "cpu.yaml"))
    p.add_argument("--output_dir", default=None, help="default: a temporary folder, removed afterwards")
    p.add_argument("--keep", action="store_true", help="keep the temporary output folder")
    p.add_argument("--timeout", type=float, default=4 * 3600.0, help="seconds before the run is stopped")
    p.add_argument("extra", nargs="*", help="overrides for the main job, after --")
    a = p.parse_args(argv)

    tmp = None
    if a.output_dir is None:
        tmp = tempfile.mkdtemp(prefix="bench_default_run.")
        out = Path(tmp) / "run"
    else:
        out = Path(a.output_dir)
        if out.exists():
            shutil.rmtree(out)  # a fresh run: a resumed one would not measure the default
    job = ["accelerate", "launch", "--config_file", a.accelerate_config, str(ROOT / "adversary" / "train.py"),
           "--config", a.config, "--output_dir", str(out), *a.extra]
    gnu_time = "/usr/bin/time" if Path("/usr/bin/time").exists() else None  # GNU time: -v reports the peak RSS
    cmd = [gnu_time, "-v", *job] if gnu_time else job
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    log("running:", " ".join(job))
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    # a session of its own: on timeout the whole launch (accelerate and the job under it) is stopped, not just
    # the first process
    child = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        stdout, stderr = child.communicate(timeout=a.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGTERM)
        try:
            stdout, stderr = child.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            stdout, stderr = child.communicate()
        log(f"timed out after {a.timeout:.0f}s")
    timed_out = child.returncode is not None and child.returncode < 0
    proc = subprocess.CompletedProcess(cmd, child.returncode, stdout, stderr)
    wall = time.perf_counter() - t0
    children_rss_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KiB on Linux
    load_after = os.getloadavg()[0]
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_seconds = usage.ru_utime + usage.ru_stime  # CPU time of the run (less sensitive to a busy machine than wall)
    time_rss_mb = None
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    if m:
        time_rss_mb = int(m.group(1)) / 1024
    tail = [ln for ln in proc.stdout.splitlines() if ln.startswith(("done:", "[td]", "warm start", "discriminator"))]
    for ln in tail:
        log("  " + ln)
    if proc.returncode != 0:
        log(proc.stdout[-3000:])
        log(proc.stderr[-3000:])
        emit({"bench": "default_run", "config": _rel(a.config), "ok": False, "returncode": proc.returncode,
              "timed_out": timed_out, "wall_seconds": r(wall, 1), "cpu_seconds": r(cpu_seconds, 1),
              "load_average_1min": [r(load_before, 1), r(load_after, 1)]})
        return 1
    summary = json.loads((out / "summary.json").read_text())
    peak = max(x for x in (time_rss_mb, children_rss_mb) if x is not None)
    record = {
        "bench": "default_run",
        "config": _rel(a.config),
        "overrides": a.extra,
        "ok": True,
        "wall_seconds": r(wall, 1),
        "job_wall_seconds": summary.get("wall_seconds"),
        "cpu_seconds": r(cpu_seconds, 1),
        # cpu_seconds / wall_seconds / host CPUs: 1.0 = the run had the machine to itself; well below 1 on a shared
        # machine, where wall time overstates the default run's cost (the load average says how busy it was)
        "cpu_share_of_host": r(cpu_seconds / wall / (os.cpu_count() or 1), 2),
        "load_average_1min": [r(load_before, 1), r(load_after, 1)],
        "peak_rss_mb": r(peak, 0),
        "peak_rss_source": "/usr/bin/time -v" if time_rss_mb is not None else "getrusage(RUSAGE_CHILDREN)",
        "job_peak_rss_mb": summary.get("peak_rss_mb"),
        "meter_share": summary.get("meter_share"),
        "meter_seconds": r((summary.get("meter_share") or 0) * (summary.get("wall_seconds") or 0), 1),
        "evaluations": _evaluations(out),
        "start_td": summary.get("start_td"),
        "best_td": summary.get("best_td"),
        "best_td_ci95": summary.get("best_td_ci95"),
        "best_step": summary.get("best_step"),
        "gate": summary.get("gate"),
        "targets": TARGETS,
    }
    record["meets"] = {
        "wall_seconds": record["wall_seconds"] <= TARGETS["wall_seconds"],
        "peak_rss_mb": record["peak_rss_mb"] <= TARGETS["peak_rss_mb"],
        "meter_share": record["meter_share"] is not None and record["meter_share"] <= TARGETS["meter_share"],
    }
    emit(record)
    if tmp and not a.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _evaluations(out: Path) -> int | None:
    curves = out / "curves.csv"
    if not curves.exists():
        return None
    return max(0, len(curves.read_text().strip().splitlines()) - 1)


def _rel(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    sys.exit(main())
