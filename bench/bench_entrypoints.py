"""The documented commands at the machine's full speed: each run the way the README writes it, beside the engine's
best (or the documented fast launch) on the same work, in one run. Alone on the machine: nothing else CPU-heavy.

    python bench/bench_entrypoints.py                    # simulate CLI + agent GRPO step (~9 min on 2 cores)
    python bench/bench_entrypoints.py --main-job         # + the bare main job against `make demo`'s launch (~20 min)
    python bench/bench_entrypoints.py --parts simulate   # one part

Parts:
- `simulate`: `python -m generator.simulate --model smollm2-135m-instruct --data sharegpt --split test --limit 200
  --out sim.jsonl` at its defaults, against the engine as the main job's meter runs it (a bf16 copy where this CPU is
  fast in bf16, batches of `sim_batch_size`, the held-out settings of configs/demo.yaml) on the same 200 contexts.
  Both rates are generated tokens (stop token included) over the generation's wall time. Target: >= 0.8.
- `agent`: `accelerate launch agent_rl/train.py --config configs/agent.yaml` for 3 GRPO steps (8 episodes each)
  against `scripted:oracle`, with the rollouts on the merged inference copy and each episode's cache kept between
  its turns and the loss's micro-batches of one prompt with its common prefix run once (the default), with the
  micro-batches by length instead (`--loss_share_prefix false`), on the merged copy prefilling each turn's whole
  episode (`--kv_cache_mb 0`), with TRL's micro-batches at the step's full width (`--loss_share_prefix false
  --loss_by_length false`), with a prompt's 4 episodes in one micro-batch (`merged_mb4`), with the inference
  copy's linear layers unpacked (`merged_unpacked`, MIMESIS_CPU_PACK=0), with TRL's own tiles in the LM head
  (`merged_trl_head`, MIMESIS_LEAN_LM_HEAD=0), and on the unmerged LoRA model with none of them, TRL's tiles, in
  micro-batches of 2 (the path before; only the whole-vocabulary draw of today's sampler, which has no switch, is
  shared with the default); seconds a step and of its rollout, after the first, and the loss's padding share and
  tokens. Target: the default >= 2x faster than
  the path before (38-49 s a step when measured first, on the Intel machine).
- `rollout`: 48 episodes of an agent (`--rollout-agent`) against `hf:smollm2-135m-instruct` as the user, sampled as
  `agent_rl.filtered_bc` plays them, with the episodes' caches kept between turns and without, alternating, twice.
- `guidance`: a guided export (`python -m adversary.guidance`, runs/guided/frozen) answering 128 requests with
  guidance off (K=1) and on (its K): seconds per turn, and their ratio.
- `main_job`: `accelerate launch adversary/train.py` exactly (bare: no --cpu, no config file, no thread count) against
  `make demo`'s `accelerate launch --config_file configs/accelerate/cpu.yaml --num_cpu_threads_per_process $(nproc)
  adversary/train.py`, each from scratch; stage seconds from each run's summary.json. Target: within 10%.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, emit, log, r  # noqa: E402

SIM_ARGV = ["--model", "smollm2-135m-instruct", "--data", "sharegpt", "--split", "test", "--limit", "200"]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS" and not k.startswith("ACCELERATE_")}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def part_simulate(tmp: Path) -> dict:
    from adversary.heldout import HELDOUT_SEED, heldout_settings
    from adversary.train import parse_args, quiet_libraries
    from conversations import load_turn_records
    from conversations.precision import inference_dtype
    from generator.engine import Engine
    from generator.model import load_generator
    from generator.prompts import render_prompt

    quiet_libraries()
    out, report = tmp / "sim.jsonl", tmp / "sim_report.json"
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "generator.simulate", *SIM_ARGV, "--out", str(out), "--real-out",
                    str(tmp / "real.jsonl"), "--report", str(report)], cwd=ROOT, env=_env(), check=True,
                   stdout=subprocess.DEVNULL)
    cli_wall = time.time() - t0
    cli = json.loads(report.read_text())
    cfg, args = parse_args(["--output_dir", str(tmp / "x")])  # configs/demo.yaml: the main job's meter settings
    model, tok = load_generator(cfg.model, dtype=inference_dtype(cfg.dtype))
    real, _ = load_turn_records(tmp / "real.jsonl")  # the CLI's own 200 contexts
    settings = heldout_settings(cfg)
    engine = Engine(model, tok, batch_size=cfg.sim_batch_size, precision=cfg.dtype)
    prompts = [render_prompt(tok, rec.context, max_context_tokens=settings.max_prompt_tokens) for rec in real]
    engine.complete_texts(prompts[:8], settings.replace(max_new_tokens=4), seed=1)  # warm-up, as the CLI's load does
    t1 = time.time()
    done = engine.complete_texts(prompts, settings, seed=HELDOUT_SEED)
    eng_s = time.time() - t1
    eng_tokens = sum(len(c.ids) for c in done)
    # the CLI's own count is of its turns' text tokens; recount its turns the engine's way for one measure
    sims, _ = load_turn_records(out)
    cli_tokens = sum(len(tok(s.user_turn, add_special_tokens=False)["input_ids"]) + 1 for s in sims)
    cli_rate, eng_rate = cli_tokens / cli["generate_s"], eng_tokens / eng_s
    return {"cli_tok_s": r(cli_rate, 1), "engine_tok_s": r(eng_rate, 1), "ratio": r(cli_rate / eng_rate),
            "target": ">= 0.8", "met": cli_rate / eng_rate >= 0.8, "cli_generate_s": cli["generate_s"],
            "cli_wall_s": r(cli_wall, 1), "cli_sampling": cli.get("sampling"), "cli_batch": cli.get("batch_size"),
            "engine_sampling": settings.to_dict(), "engine_batch": cfg.sim_batch_size, "contexts": len(real)}


MICRO_BATCHES_OF_2 = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4"]  # the default's
AGENT_VARIANTS = {
    "merged": [],  # the default: merged copy, the episodes' caches, micro-batches of one prompt with its prefix once
    "merged_by_length": ["--loss_share_prefix", "false"],
    "merged_no_kv": ["--kv_cache_mb", "0"],
    "merged_full_width": ["--loss_share_prefix", "false", "--loss_by_length", "false"],
    "merged_mb4": ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"],  # a prompt's 4
    # episodes in one micro-batch: its prefix run once, not twice
    "merged_unpacked": [],  # the default with the inference copy's linear layers unpacked (AGENT_VARIANT_ENV)
    "merged_trl_head": [],  # the default with TRL's own tiles in its LM head (AGENT_VARIANT_ENV)
    "unmerged": ["--rollout_merge", "false", "--kv_cache_mb", "0", "--loss_share_prefix", "false",
                 "--loss_by_length", "false", *MICRO_BATCHES_OF_2],  # the path before
}
AGENT_VARIANT_ENV = {"merged_unpacked": {"MIMESIS_CPU_PACK": "0"}, "merged_trl_head": {"MIMESIS_LEAN_LM_HEAD": "0"},
                     "unmerged": {"MIMESIS_CPU_PACK": "0", "MIMESIS_LEAN_LM_HEAD": "0"}}


def part_agent(tmp: Path, steps: int = 3, variants: list[str] | None = None) -> dict:
    res = {}
    for label in variants or list(AGENT_VARIANTS):
        extra = AGENT_VARIANTS[label]
        outdir = tmp / f"agent_{label}"
        cmd = ["accelerate", "launch", "--config_file", str(ROOT / "configs/accelerate/cpu.yaml"),
               "--num_cpu_threads_per_process", str(os.cpu_count()), str(ROOT / "agent_rl/train.py"),
               "--config", str(ROOT / "configs/agent.yaml"), "--max_steps", str(steps), "--save_steps", "1000",
               "--report_to", "none", "--output_dir", str(outdir), *extra]
        t0 = time.time()
        p = subprocess.run(cmd, cwd=ROOT, env={**_env(), **AGENT_VARIANT_ENV.get(label, {})}, capture_output=True,
                           text=True)
        wall = time.time() - t0
        if p.returncode != 0:
            raise RuntimeError(f"agent run {label} failed: {p.stderr[-2000:]}")
        hist = json.loads((outdir / "agent_rl.json").read_text())["log_history"]
        times = [h["agent/step_seconds"] for h in hist if "agent/step_seconds" in h]
        rollouts = [h["agent/rollout_seconds"] for h in hist if "agent/rollout_seconds" in h]
        padding = [h["agent/loss_padding"] for h in hist if "agent/loss_padding" in h]
        ran = [h["agent/loss_tokens"] for h in hist if "agent/loss_tokens" in h]
        spared = [h.get("agent/loss_shared_tokens", 0.0) for h in hist if "agent/loss_tokens" in h]
        res[label] = {"loss_padding": [r(x) for x in padding], "loss_tokens": [int(x) for x in ran],
                      "loss_shared_tokens_per_micro_batch": [r(x, 1) for x in spared],
                      "loss_seconds": [r(t - o, 1) for t, o in zip(times, rollouts)],  # the step less its rollout
                      "wall_s": r(wall, 1), "step_seconds": [r(t, 1) for t in times],
                      "rollout_seconds": [r(t, 1) for t in rollouts],
                      "steady_rollout_s": r(sum(rollouts[1:]) / (len(rollouts) - 1), 1) if len(rollouts) > 1 else None,
                      "steady_step_s": r(sum(times[1:]) / max(1, len(times) - 1), 1) if len(times) > 1 else
                      (r(times[0], 1) if times else None)}
    step = {k: v["steady_step_s"] for k, v in res.items()}
    m, u, nk, bl, fw = (step.get(k) for k in ("merged", "unmerged", "merged_no_kv", "merged_by_length",
                                              "merged_full_width"))
    res["speedup_vs_unmerged"] = r(u / m) if m and u else None
    res["speedup_of_kv_cache"] = r(nk / m) if m and nk else None  # the step with / without the cross-turn cache
    res["speedup_of_shared_prefix"] = r(bl / m) if m and bl else None  # against micro-batches by length
    res["speedup_of_loss_by_length"] = r(fw / bl) if bl and fw else None  # by length against TRL's full width
    mb4, unpacked, trl_head = step.get("merged_mb4"), step.get("merged_unpacked"), step.get("merged_trl_head")
    res["speedup_of_lean_lm_head"] = r(trl_head / m) if m and trl_head else None
    res["speedup_of_micro_batches_of_4"] = r(m / mb4) if m and mb4 else None
    res["speedup_of_packed_linears"] = r(unpacked / m) if m and unpacked else None
    res["before_s"] = "38-49 (docs/results.md, 2026-12-01)"
    res["met"] = bool(m and u and u / m >= 2)  # 2x the path before, both measured in this run
    return res


def part_rollout(tmp: Path, agent_spec: str = "hf:smollm2-135m-instruct", user: str = "hf:smollm2-135m-instruct",
                 episodes: int = 48, repeats: int = 2, agent_batch: int = 16, kv_mb: float | None = None,
                 live: tuple[int, ...] = ()) -> dict:
    """Episodes as agent_rl.filtered_bc and agent_rl.evaluate play them (the agent sampled as evaluated, an LM user):
    all live at once with every episode's cache kept between turns (agent and user, `kv_mb` a side) and without
    (`kv_cache_mb` 0), and with the caches at each of `live` episodes at once; in alternation, the same seeds each
    time: seconds of the agent's and the user's turns, and how many episodes came out token for token the same as
    without (the cache changes the arithmetic's order, not the distribution)."""
    from agent_rl.agents import EVAL_TEMPERATURE, EVAL_TOP_P, load_agent
    from agent_rl.curve import EVAL_MAX_NEW_TOKENS
    from agent_rl.rollout import RolloutStats, episode_specs, run_episodes
    from agent_rl.users import load_simulator
    from conversations.threads import apply_threads
    from generator.engine.resume import KV_CACHE_MB, CacheStore

    apply_threads()
    kv_mb = KV_CACHE_MB if kv_mb is None else kv_mb
    agent = load_agent(agent_spec, max_new_tokens=EVAL_MAX_NEW_TOKENS, temperature=EVAL_TEMPERATURE, top_p=EVAL_TOP_P,
                       batch_size=agent_batch)
    sim = load_simulator(user)
    gyms = ["intention", "travel", "persuade"]
    specs = [s for g in gyms for s in episode_specs([g], "train", episodes // len(gyms))]
    modes = [("kept", None, kv_mb), ("none", None, 0)] + [(f"kept_live{n}", n, kv_mb) for n in live]
    runs: dict[str, list] = {m[0]: [] for m in modes}
    texts: dict[str, list] = {}
    for _ in range(repeats):
        for label, max_live, mb in modes:
            agent.kv, sim.kv = CacheStore(mb), CacheStore(mb)
            agent.calls, sim.calls = 0, 0  # the same seeds every time
            stats = RolloutStats()
            res = run_episodes(agent, sim, specs, stats=stats, max_live=max_live)
            texts[label] = [[m["content"] for m in e.messages] for e in res]
            runs[label].append({"agent_s": r(stats.agent_seconds, 1), "user_s": r(stats.simulator_seconds, 1),
                                "total_s": r(stats.seconds, 1), "mean_return": r(sum(e.total for e in res) / len(res)),
                                "turns": sum(e.turns for e in res)})
    med = {k: {f: r(sorted(x[f] for x in v)[len(v) // 2], 1) for f in ("agent_s", "user_s", "total_s")}
           for k, v in runs.items()}
    base = med["none"]
    return {"agent": agent_spec, "user": user, "episodes": len(specs), "agent_batch": agent_batch, "kv_mb": kv_mb,
            "runs": runs, "median": med,
            "speedup_vs_none": {k: {f: r(base[f] / v[f]) for f in v} for k, v in med.items() if k != "none"},
            "same_episodes_as_none": {k: sum(a == b for a, b in zip(t, texts["none"])) for k, t in texts.items()
                                      if k != "none"}}


def part_guidance(tmp: Path, export: str = "runs/guided/frozen", n: int = 128) -> dict:
    """The cost of a guided turn: `load_simulator(export)` answering the same requests with K=1 (guidance off) and
    with the export's K, seconds per turn (one call for the whole batch, as a lock-step rollout makes)."""
    from agent_rl.gyms import UserRequest
    from agent_rl.users import load_simulator
    from generator.data import load_turns, sample_records

    if not (ROOT / export / "guide").is_dir():
        raise RuntimeError(f"no guided export at {export}: python -m adversary.guidance --model "
                           "runs/guided/warmstart/merged --guided runs/guided/disc --out runs/guided/frozen")
    recs = sample_records(load_turns("sharegpt", "test", max_context_messages=2, max_turn_chars=300), n, seed=7)
    reqs = [UserRequest(context=[{**m, "role": {"user": "assistant", "assistant": "user"}.get(m["role"], m["role"])}
                                 for m in rec.context] + [{"role": "assistant", "content": "What do you need?"}],
                        goal="", gym="serve", task=None) for rec in recs]
    out = {}
    for label, spec in (("k1", f"frozen:{ROOT / export}#guidance=1"), ("guided", f"frozen:{ROOT / export}")):
        sim = load_simulator(spec, batch_size=128)
        sim.reply(reqs[:8])  # warm-up
        t0 = time.time()
        sim.reply(reqs)
        out[label] = {"seconds_per_turn": r((time.time() - t0) / n, 4), "k": sim.guide.k if sim.guide else 1}
    out["cost_ratio"] = r(out["guided"]["seconds_per_turn"] / out["k1"]["seconds_per_turn"], 2)
    return out


def _main_job(tmp: Path, label: str, launch: list[str]) -> dict:
    outdir = tmp / f"main_{label}"
    t0 = time.time()
    p = subprocess.run(launch + [str(ROOT / "adversary/train.py"), "--output_dir", str(outdir)], cwd=ROOT, env=_env(),
                       capture_output=True, text=True)
    wall = time.time() - t0
    if p.returncode != 0:
        raise RuntimeError(f"main job {label} failed: {p.stderr[-2000:]}")
    s = json.loads((outdir / "summary.json").read_text())
    return {"wall_s": r(wall, 1), "stage_seconds": s["stage_seconds"], "threads": s.get("threads"),
            "best_td": s["best_td"], "peak_rss_mb": s["peak_rss_mb"]}


def part_main_job(tmp: Path) -> dict:
    bare = _main_job(tmp, "bare", ["accelerate", "launch"])
    demo = _main_job(tmp, "make_demo", ["accelerate", "launch", "--config_file", str(ROOT / "configs/accelerate/cpu.yaml"),
                                        "--num_cpu_threads_per_process", str(os.cpu_count())])
    ratios = {k: r(v / demo["stage_seconds"][k]) for k, v in bare["stage_seconds"].items()
              if demo["stage_seconds"].get(k)}
    return {"bare": bare, "make_demo": demo, "stage_ratio_bare_over_demo": ratios,
            "wall_ratio": r(bare["wall_s"] / demo["wall_s"]), "target": "<= 1.10 every stage",
            "met": all(v <= 1.10 for k, v in ratios.items() if demo["stage_seconds"][k] >= 5)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", default=None, choices=["simulate", "agent", "rollout", "guidance", "main_job"])
    p.add_argument("--main-job", action="store_true", help="include the main-job pair (~20 min)")
    p.add_argument("--agent-steps", type=int, default=3)
    p.add_argument("--agent-variants", nargs="+", default=None, choices=list(AGENT_VARIANTS),
                   help="the agent part's variants (default: all)")
    p.add_argument("--rollout-agent", default="hf:smollm2-135m-instruct", help="the rollout part's agent (a path: "
                   "an agent checkpoint, e.g. the protocol SFT agent)")
    p.add_argument("--rollout-episodes", type=int, default=48)
    p.add_argument("--rollout-repeats", type=int, default=2)
    p.add_argument("--rollout-agent-batch", type=int, default=16, help="agent turns per engine call (filtered_bc: 48)")
    p.add_argument("--rollout-kv-mb", type=float, default=None, help="cache budget a side (default: the engine's)")
    p.add_argument("--rollout-live", type=int, nargs="*", default=[], help="also with the caches at N episodes at once")
    a = p.parse_args(argv)
    parts = a.parts or (["simulate", "agent", "guidance"] + (["main_job"] if a.main_job else []))
    out = {"bench": "entrypoints"}
    with tempfile.TemporaryDirectory(prefix="bench_entry_") as d:
        tmp = Path(d)
        for part in parts:
            log(f"== {part}")
            t0 = time.time()
            out[part] = {"simulate": part_simulate, "agent": lambda t: part_agent(t, a.agent_steps, a.agent_variants),
                         "rollout": lambda t: part_rollout(t, a.rollout_agent, episodes=a.rollout_episodes,
                                                           repeats=a.rollout_repeats, agent_batch=a.rollout_agent_batch,
                                                           kv_mb=a.rollout_kv_mb, live=tuple(a.rollout_live)),
                         "guidance": part_guidance, "main_job": part_main_job}[part](tmp)
            out[part]["bench_seconds"] = r(time.time() - t0, 1)
            log(json.dumps(out[part]))
    emit(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
