#!/usr/bin/env bash
# The swap-only-the-simulator pair of issue #30, end to end on one CPU machine, resumable: every stage skips what it
# has finished (the SFT agent, each filtered-BC round, the default run's export, every cached report episode), so a
# run stopped anywhere goes on from there when started again.
#
#   bash agent_rl/recipes/swap_pair.sh [RUNS_DIR]        # from the repository root; default runs/agents
#
# 1. protocol SFT on the scripted oracle agent's turns (train tasks of every gym);
# 2. filtered behaviour cloning against the scripted user, 4 rounds, shared by both agents (the stage with evidence of
#    learning: docs/results.md, "Filtered behaviour cloning instead of GRPO"), read against scripted:oracle;
# 3. the realistic simulator: the default run's guided export (`make demo`: runs/demo/frozen), and its warm start;
# 4. from the shared agent, two mixed rounds per agent, the scripted user plus ONE LM user, the only difference:
#    A the prompted base model, B the guided export; read against scripted:terse (a user neither meets);
# 5. the report: every agent against scripted:oracle on fresh seeds (10-17), then B - A on four users neither met.
set -euo pipefail
R=${1:-runs/agents}
L="accelerate launch --config_file configs/accelerate/cpu.yaml --num_cpu_threads_per_process $(nproc)"
FBC="--gyms intention,travel,persuade --samples_per_task 4 --epochs 1 --learning_rate 1e-4 --eval_repeats 3"
stage() { echo "== $(date -u +%FT%TZ) $*"; }
# the agent a filtered-BC run ended with (a round that kept nothing trained no adapter: its predecessor's)
last_agent() {
    python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['curve'][-1]['agent'])" "$1/filtered_bc.json"
}

stage "1 protocol SFT"
[ -f "$R/sft/agent_sft.json" ] || $L agent_rl/sft.py --gyms all --output_dir "$R/sft" --max_steps 160 \
    --curve_every 20 --logging_steps 10 --per_device_eval_batch_size 8

stage "2 filtered BC against the scripted user (shared)"
$L agent_rl/filtered_bc.py --agent_model "$R/sft" --simulator scripted:oracle $FBC --rounds 4 \
    --eval_simulators scripted:oracle --output_dir "$R/fbc-S"
S=$(last_agent "$R/fbc-S")

stage "3 the default run's guided export"
[ -f runs/demo/frozen/simulator.json ] || make demo
WS=$(python3 -c "import json; print(json.load(open('runs/demo/warmstart/COMPLETE'))['merged_dir'])")

for pair in "mixA hf:smollm2-135m-instruct" "mixB frozen:runs/demo/frozen"; do
    set -- $pair
    stage "4 $1: the scripted user and $2"
    $L agent_rl/filtered_bc.py --agent_model "$S" --simulator "scripted:oracle,$2" $FBC --rounds 2 \
        --eval_simulators scripted:terse --output_dir "$R/fbc-$1"
done

stage "5 the report"
python3 -m agent_rl.report --agents untuned=hf:smollm2-135m-instruct sft="$R/sft" shared="$S" \
    mixA="$(last_agent "$R/fbc-mixA")" mixB="$(last_agent "$R/fbc-mixB")" --reference scripted:oracle \
    --pair mixA mixB --simulators scripted:terse "hf:$WS" \
    "hf:smollm2-135m-instruct#persona=a busy engineer who writes short, lower-case messages and gets impatient" \
    "hf:$WS#persona=someone who starts vague, gives details only when asked, and changes their mind once" \
    --gyms all --repeats 8 --first_seed 10 --pair_repeats 3 --out "$R/report" --json "$R/agents.json"
stage "done: $R/agents.json"
