"""CPU threads chosen by the program, not by the launcher's accident.

A bare `accelerate launch script.py` (no `--cpu`, no config file, no `--num_cpu_threads_per_process`) sets
`OMP_NUM_THREADS=1` in its child: accelerate only sizes threads itself when `use_cpu` is set (accelerate/commands/
launch.py). One process on a CPU then runs on one core (measured: the default run 32.6 min instead of 29.8 on this
2-core machine). `choose_threads` tells that 1 apart from a 1 the user asked for by looking at the launcher: the
parent process's command line and environment (Linux /proc). Rules, in order:

1. `MIMESIS_THREADS=N` -> N (ours, explicit).
2. Under accelerate: `--num_cpu_threads_per_process N` on the launcher's command line, or `OMP_NUM_THREADS` in the
   launcher's own environment -> kept (the user's value). Otherwise the child's `OMP_NUM_THREADS` is the launcher's
   default -> the physical cores this process may run on, divided by the local processes.
3. Not under accelerate: `OMP_NUM_THREADS` set -> kept; unset -> the physical cores available.

"Physical cores available": the CPUs of this process's affinity mask (`os.sched_getaffinity`), counted once per
(package, core) from /sys topology, so hyper-threads do not count twice.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

ENV_OURS = "MIMESIS_THREADS"


@dataclass(frozen=True)
class ThreadChoice:
    threads: int  # intra-op threads this process uses
    source: str  # "ours" (MIMESIS_THREADS), "user" (kept), "chosen" (physical cores), "gpu" (left alone)
    reason: str  # one line for the log
    overrode: bool = False  # True: the launcher's default was replaced (worth a line even where stderr is terse)

    def to_dict(self) -> dict:
        return asdict(self)


def physical_cores(cpus=None, sys_root: str = "/sys/devices/system/cpu") -> int:
    """Distinct (package, core) pairs among `cpus` (default: this process's affinity); the CPU count when the
    topology cannot be read."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None and hasattr(os, "sched_getaffinity") else
                  (cpus if cpus is not None else range(os.cpu_count() or 1)))
    cores = set()
    for c in cpus:
        topo = Path(sys_root) / f"cpu{c}" / "topology"
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


def _read_proc(pid: int, name: str) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return None


def launcher_info(ppid: int | None = None) -> dict | None:
    """{'argv': [...], 'env': {...}} of the parent process when it is `accelerate launch`, else None."""
    ppid = os.getppid() if ppid is None else ppid
    raw = _read_proc(ppid, "cmdline")
    if not raw:
        return None
    argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    head = argv[:4]
    cli = any(Path(a).name == "accelerate" for a in head) and "launch" in head  # `accelerate launch ...`
    module = any(a in ("accelerate.commands.launch", "accelerate.commands.accelerate_cli") or
                 a.endswith("accelerate/commands/launch.py") for a in head)  # `python -m accelerate.commands.launch`
    if not (cli or module):
        return None
    env_raw = _read_proc(ppid, "environ")
    env = {}
    for kv in (env_raw or b"").split(b"\0"):
        k, eq, v = kv.decode(errors="replace").partition("=")
        if eq:
            env[k] = v
    return {"argv": argv, "env": env, "env_readable": env_raw is not None}


def choose_threads(environ=None, launcher: dict | None | str = "detect", cores: int | None = None,
                   on_gpu: bool = False) -> ThreadChoice:
    """The thread count by the rules of the module docstring (pure given its inputs; tests pass them)."""
    env = os.environ if environ is None else environ
    if launcher == "detect":
        launcher = launcher_info() if any(k.startswith("ACCELERATE_") for k in env) else None
    if on_gpu:
        return ThreadChoice(int(env.get("OMP_NUM_THREADS") or 0) or 1, "gpu", "a GPU run: threads left to the launcher")
    local = max(1, int(env.get("LOCAL_WORLD_SIZE") or env.get("WORLD_SIZE") or 1))
    n_cores = cores if cores is not None else physical_cores()
    physical = max(1, n_cores // local)
    if env.get(ENV_OURS):
        return ThreadChoice(max(1, int(env[ENV_OURS])), "ours", f"{ENV_OURS}={env[ENV_OURS]}")
    omp = env.get("OMP_NUM_THREADS")
    if launcher is not None:
        argv = launcher.get("argv", [])
        asked = next((a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else None)
                      for i, a in enumerate(argv) if a.startswith("--num_cpu_threads_per_process")), None)
        if asked:
            return ThreadChoice(max(1, int(asked)), "user", f"--num_cpu_threads_per_process {asked} given to accelerate")
        if "OMP_NUM_THREADS" in launcher.get("env", {}) or not launcher.get("env_readable", True):
            value = omp or launcher["env"].get("OMP_NUM_THREADS", "1")
            return ThreadChoice(max(1, int(value)), "user", f"OMP_NUM_THREADS={value} set before accelerate launch")
        return ThreadChoice(physical, "chosen", f"accelerate launch set OMP_NUM_THREADS={omp} by default; using the "
                            f"{physical} physical core(s) available to this process (set OMP_NUM_THREADS or "
                            f"--num_cpu_threads_per_process to choose)", overrode=omp != str(physical))
    if omp:
        return ThreadChoice(max(1, int(omp)), "user", f"OMP_NUM_THREADS={omp}")
    return ThreadChoice(physical, "chosen", f"the {physical} physical core(s) available to this process")


def apply_threads(on_gpu: bool | None = None, announce: bool | None = None) -> ThreadChoice:
    """Choose and set torch's intra-op threads (and OMP_NUM_THREADS for child processes). Entry points call it
    through `conversations.cli_util.start_process`, first, before any model. The choice is printed on stderr when the launcher's default was replaced
    (`announce` None), always (True) or never (False): a CLI whose error must stay one line prints nothing else."""
    import torch

    if on_gpu is None:
        on_gpu = torch.cuda.is_available()
    choice = choose_threads(on_gpu=on_gpu)
    if choice.source != "gpu":
        torch.set_num_threads(choice.threads)
        os.environ["OMP_NUM_THREADS"] = str(choice.threads)
    if (choice.overrode if announce is None else announce) and int(os.environ.get("RANK", "0") or 0) == 0:
        import sys

        print(f"threads: {choice.threads} ({choice.reason})", file=sys.stderr, flush=True)  # stdout may be JSON
    return choice
