"""The thread count is the program's choice, not the launcher's accident (conversations.threads)."""

from conversations.threads import choose_threads, physical_cores

ACCEL = {"ACCELERATE_USE_CPU": "False", "OMP_NUM_THREADS": "1"}  # what a bare `accelerate launch` leaves in the child


def launcher(argv=("accelerate", "launch", "train.py"), env=None):
    return {"argv": ["/usr/bin/python3", *argv], "env": dict(env or {}), "env_readable": True}


def test_the_launchers_default_one_is_replaced_by_the_physical_cores():
    c = choose_threads(ACCEL, launcher(), cores=8)
    assert (c.threads, c.source, c.overrode) == (8, "chosen", True) and "OMP_NUM_THREADS=1 by default" in c.reason
    assert not choose_threads({}, None, cores=8).overrode


def test_an_explicit_value_given_to_the_launcher_is_kept():
    c = choose_threads(ACCEL, launcher(("accelerate", "launch", "--num_cpu_threads_per_process", "1", "t.py")), cores=8)
    assert (c.threads, c.source) == (1, "user")
    c = choose_threads({**ACCEL, "OMP_NUM_THREADS": "3"},
                       launcher(("accelerate", "launch", "--num_cpu_threads_per_process=3", "t.py")), cores=8)
    assert (c.threads, c.source) == (3, "user")
    c = choose_threads(ACCEL, launcher(env={"OMP_NUM_THREADS": "1"}), cores=8)  # OMP_NUM_THREADS=1 accelerate launch
    assert (c.threads, c.source) == (1, "user")


def test_an_unreadable_launcher_environment_keeps_the_value():
    c = choose_threads({**ACCEL, "OMP_NUM_THREADS": "2"}, {"argv": ["accelerate", "launch"], "env": {},
                                                          "env_readable": False}, cores=8)
    assert (c.threads, c.source) == (2, "user")


def test_without_a_launcher_omp_is_kept_and_unset_means_the_cores():
    c = choose_threads({"OMP_NUM_THREADS": "1"}, None, cores=8)
    assert (c.threads, c.source) == (1, "user")
    c = choose_threads({}, None, cores=6)
    assert (c.threads, c.source) == (6, "chosen")
    c = choose_threads({"MIMESIS_THREADS": "5", "OMP_NUM_THREADS": "1"}, None, cores=6)
    assert (c.threads, c.source) == (5, "ours")


def test_local_processes_share_the_cores():
    c = choose_threads({**ACCEL, "LOCAL_WORLD_SIZE": "2"}, launcher(), cores=8)
    assert c.threads == 4


def test_physical_cores_counts_hyperthreads_once(tmp_path):
    # cpu0/cpu1 are two threads of core 0, cpu2 is core 1: affinity {0, 1, 2} -> 2 cores; {0, 1} -> 1
    for cpu, core in ((0, 0), (1, 0), (2, 1)):
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "core_id").write_text(f"{core}\n")
        (topo / "physical_package_id").write_text("0\n")
    assert physical_cores([0, 1, 2], sys_root=str(tmp_path)) == 2
    assert physical_cores([0, 1], sys_root=str(tmp_path)) == 1
    assert physical_cores([0, 7], sys_root=str(tmp_path)) == 2  # no topology for cpu7: the CPU count


def test_a_bare_accelerate_launch_child_gets_the_cores_and_an_explicit_one_is_kept(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "probe.py"
    script.write_text(
        "import json, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})\n"
        "import torch\nfrom conversations.threads import apply_threads\n"
        "c = apply_threads(on_gpu=False, announce=False)\n"
        "print(json.dumps({'torch': torch.get_num_threads(), **c.to_dict()}))\n")
    accelerate = [sys.executable, "-m", "accelerate.commands.launch"]
    env = {k: v for k, v in __import__("os").environ.items() if k != "OMP_NUM_THREADS" and not k.startswith("ACCELERATE")}

    def run(*flags):
        out = subprocess.run(accelerate + list(flags) + [str(script)], capture_output=True, text=True, env=env,
                             timeout=120, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    bare = run()
    assert bare["source"] == "chosen" and bare["torch"] == bare["threads"] == physical_cores()
    kept = run("--num_cpu_threads_per_process", "1")
    assert kept["source"] == "user" and kept["torch"] == kept["threads"] == 1

