"""The swap-pair recipe (agent_rl/recipes/swap_pair.sh) runs for hours: a misspelt option must fail here, not at
hour three. Every option it passes to an entry point is one that entry point's typed config declares."""

import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "agent_rl" / "recipes" / "swap_pair.sh"
ENTRIES = ("agent_rl/sft.py", "agent_rl/filtered_bc.py", "agent_rl.report")


def recipe_options(text: str) -> list[tuple[str, set[str]]]:
    """(entry point, the --options after it) for every command of the script, its "$VAR" options expanded."""
    joined = text.replace("\\\n", " ")
    variables = dict(re.findall(r'^(\w+)="([^"]*)"', joined, re.M))
    found = []
    for line in joined.splitlines():
        if line.lstrip().startswith("#"):
            continue
        line = re.sub(r"\$(\w+)", lambda m: variables.get(m.group(1), m.group(0)), line)
        for entry in ENTRIES:
            if entry in line:
                found.append((entry, set(re.findall(r"(?<![\w-])--(\w+)", line.split(entry, 1)[1]))))
    return found


def declared(entry: str) -> set[str]:
    from trl import SFTConfig

    from agent_rl.filtered_bc import FilteredBCArgs
    from agent_rl.report import ReportArgs
    from agent_rl.sft import AgentSFTArgs

    types = {"agent_rl/sft.py": (AgentSFTArgs, SFTConfig), "agent_rl/filtered_bc.py": (FilteredBCArgs, SFTConfig),
             "agent_rl.report": (ReportArgs,)}[entry]
    return {f.name for t in types for f in dataclasses.fields(t)} | {"config"}


def test_recipe_parser_sees_options_and_expands_variables():
    text = 'X="--rounds 2 --eval_repeats 3"\nfoo agent_rl/filtered_bc.py --simulator a,b $X \\\n  --out_dir d\n'
    assert recipe_options(text) == [("agent_rl/filtered_bc.py", {"simulator", "rounds", "eval_repeats", "out_dir"})]


def test_swap_pair_recipe_passes_only_declared_options():
    found = recipe_options(SCRIPT.read_text())
    assert sorted(entry for entry, _ in found) == sorted(
        ["agent_rl/sft.py", "agent_rl/filtered_bc.py", "agent_rl/filtered_bc.py", "agent_rl.report"])
    for entry, options in found:
        unknown = options - declared(entry)
        assert not unknown, f"{SCRIPT.name} passes {sorted(unknown)} to {entry}, which does not declare them"
    # the two agents differ by the simulator alone: one filtered-BC command line, looped over the pair
    assert "--pair mixA mixB" in SCRIPT.read_text()


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_swap_pair_recipe_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
