"""Shared plumbing of the benchmarks: import path, the JSON line every benchmark prints, robust statistics.

A benchmark prints exactly one JSON line on stdout (progress goes to stderr): what was measured, the numbers, the
target and whether it was met, and where it ran (date, host CPUs, library versions, git commit), so that a line
pasted into docs/benchmarks.md says everything needed to reproduce it."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python bench/bench_x.py` from anywhere
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing downloads from a model hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def median(xs) -> float:
    xs = [float(x) for x in xs]
    return statistics.median(xs) if xs else float("nan")


def iqr(xs) -> list[float]:
    """[q25, q75] of the sample (a spread that one slow outlier on a shared machine does not dominate)."""
    xs = sorted(float(x) for x in xs)
    if len(xs) < 2:
        return [xs[0], xs[0]] if xs else [float("nan"), float("nan")]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return [q[0], q[2]]


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    import torch

    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({platform.processor() or platform.machine()})",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": _git_commit(),
    }
    for mod in ("transformers", "trl", "accelerate", "peft"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = None
    return env


def emit(record: dict) -> dict:
    """Print the benchmark's one JSON line (with the environment under "env") and return it."""
    out = dict(record)
    out["env"] = environment()
    print(json.dumps(out, default=_jsonable), flush=True)
    return out


def _jsonable(o):
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
    except ImportError:
        pass
    if isinstance(o, Path):
        return str(o)
    return str(o)


def r(x, nd: int = 3):
    """Round for the JSON line (None and NaN pass through as None)."""
    if x is None or x != x:
        return None
    return round(float(x), nd)
