"""Throughput by precision and path, on this machine, at the demo preset's shapes (issue: throughput).

    python bench/bench_precision.py                 # everything below, SmolLM2-135M, the demo preset
    python bench/bench_precision.py --only sft      # one part: matmul | sft | heldout | grpo

- **matmul**: GFLOP/s of a 1024 x 1024 matmul in fp32 and under bf16 autocast (best of 8), the arithmetic limit.
- **sft**: the warm start's SFT steps through TRL's SFTTrainer as `adversary.stages.warm_start` builds it (LoRA of
  the preset, its batch, prompt and sequence budgets, the real turns), three variants each in its own process
  (accelerate fixes the precision once per process), the order rotated every round, the first step of each process
  dropped: `before` (fp32, micro-batch 2, sdpa, TRL's fused head over every position: the path before this round's
  CPU training fixes), `fp32` and `bf16` (the preset's micro-batch, `generator.model.prepare_training`). `ratio` is
  bf16 over before. Tokens/s count the non-pad tokens; the limit is the bf16 matmul rate over 4 x params FLOPs a
  token (forward 2N, gradients of the activations 2N; LoRA's own weight gradients are negligible).
- **heldout**: one held-out evaluation's simulation (the preset's held-out contexts, prompt budget and token
  budget) by the path before the engine (`_baseline_generation.py`: transformers' `generate` over an fp32 merged
  copy, shared system-prompt cache, one-level nucleus sampler, batches of 64 as the demo had them) against the
  engine on the inference copy of the run's precision at the preset's `sim_batch_size`, interleaved in one process;
  tokens/s of generated tokens.
- **grpo**: the preset's GRPO step (`adversary.loop.grpo_trainer`, a constant reward, completions forced to the full
  `max_completion_length` so every variant does the same work), the same three variants (`before`: fp32, TRL's own
  `generate` and defaults; `fp32`, `bf16`: `prepare_training` and the engine's rollouts), each in its own process,
  the order rotated; the first step of each process dropped. `ratio` is bf16 over before.

The machine is shared and its speed drifts (docs/benchmarks.md): every ratio is measured within one run, the
variants interleaved. Prints one JSON line."""

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
from _common import ROOT, emit, log, median, r  # noqa: E402

PARTS = ("matmul", "sft", "heldout", "grpo")


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    p.add_argument("--only", nargs="*", choices=PARTS, default=list(PARTS))
    p.add_argument("--sft_steps", type=int, default=4, help="measured SFT steps per process (after 1 warm-up)")
    p.add_argument("--sft_rounds", type=int, default=2, help="processes per SFT variant")
    p.add_argument("--sft_worker", default=None, choices=SFT_VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--heldout_repeats", type=int, default=2, help="held-out simulations per variant")
    p.add_argument("--heldout_contexts", type=int, default=None, help="default: the preset's heldout_contexts")
    p.add_argument("--grpo_steps", type=int, default=4, help="GRPO steps per process (the first is dropped)")
    p.add_argument("--grpo_rounds", type=int, default=2, help="processes per GRPO variant")
    p.add_argument("--model", default=None, help="simulator weights (default: the preset's model)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="preset keys to override (e.g. heldout_max_new_tokens=96)")
    p.add_argument("--grpo_worker", default=None, choices=("before", "fp32", "bf16"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def job_config(a, *extra):
    from adversary.train import parse_args

    tmp = tempfile.mkdtemp(prefix="bench_precision.")
    over = ["--output_dir", tmp, "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]
    for kv in a.set:
        k, _, v = kv.partition("=")
        over += [f"--{k}", v]
    over += list(extra)
    if a.model:
        over += ["--model", a.model]
    return parse_args(["--config", a.config, *over])


# ------------------------------------------------------------------------------------------------------------ parts


def bench_matmul() -> dict:
    from conversations.precision import measure_cpu_matmul

    rates = measure_cpu_matmul()
    return {"fp32_gflops": r(rates["fp32"], 1), "bf16_gflops": r(rates["bf16"], 1), "ratio": r(rates["bf16"] / rates["fp32"])}


# the SFT path before this round's changes, the baseline `sft` is measured against: fp32, the demo's micro-batch of
# then (2), sdpa attention and TRL's fused LM head over every position (commit bc2b324)
BEFORE_SFT_MICRO_BATCH = 2
SFT_VARIANTS = ("before", "fp32", "bf16")
# the held-out simulation before: the path of `_baseline_generation.py` at the demo's batch size of then
BEFORE_SIM_BATCH_SIZE = 64


def sft_worker(a) -> int:
    """One process: the warm start's SFT steps (TRL SFTTrainer, as `adversary.stages.warm_start` builds it) in one
    variant; prints step times and non-pad tokens as JSON. `before`: fp32, micro-batch 2, no `prepare_training`."""
    import resource

    import torch
    from transformers import TrainerCallback

    from adversary.stages import prepare_data, warm_start_config
    from adversary.train import quiet_libraries
    from generator.model import LoraSettings, load_generator, prepare_training
    from generator.sft import make_trainer, prepare_config

    variant = a.sft_worker
    extra = ["--dtype", "fp32" if variant in ("before", "fp32") else "bf16"]
    if variant == "before":
        extra += ["--warmstart_micro_batch", str(BEFORE_SFT_MICRO_BATCH)]
    cfg, args = job_config(a, *extra)
    quiet_libraries()
    data = prepare_data(cfg, 0)
    sft_args, config = warm_start_config(cfg, args, Path(tempfile.mkdtemp(prefix="bench_sft.")), a.sft_steps + 1, 0)
    prepare_config(sft_args, config, "cpu")
    config.include_num_input_tokens_seen, config.logging_steps, config.save_strategy = "non_padding", 10_000, "no"
    torch.manual_seed(0)
    model, tok = load_generator(cfg.model, lora=LoraSettings(r=sft_args.lora_r, alpha=sft_args.lora_alpha,
                                                             dropout=sft_args.lora_dropout))
    if variant != "before":
        prepare_training(model, "cpu", config.max_length)
    times, tokens = [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **k):
            self.t0, self.n0 = time.perf_counter(), state.num_input_tokens_seen

        def on_step_end(self, args, state, control, **k):
            times.append(time.perf_counter() - self.t0)
            tokens.append(int(state.num_input_tokens_seen - self.n0))

    trainer = make_trainer(sft_args, config, model, tok, data.warmstart, callbacks=[Timer()])
    trainer.train()
    print(json.dumps({"variant": variant, "mixed_precision": trainer.accelerator.mixed_precision,
                      "micro_batch": config.per_device_train_batch_size,
                      "attention": model.config._attn_implementation, "step_s": times, "tokens": tokens,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))
    return 0


def _worker(a, flag: str, value: str, steps_flag: str, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--config", a.config, flag, value, steps_flag, str(steps), "--set", *a.set]
    if a.model:
        cmd += ["--model", a.model]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    if out.returncode:
        raise RuntimeError(f"worker {flag} {value} failed: {out.stderr.strip().splitlines()[-3:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_sft(a, cfg) -> dict:
    """Each variant in its own process (accelerate fixes the precision once per process), the order rotated every
    round; the first step of each process is dropped."""
    times = {v: [] for v in SFT_VARIANTS}
    tokens = {v: [] for v in SFT_VARIANTS}
    info = {}
    for rnd in range(a.sft_rounds):
        order = SFT_VARIANTS[rnd % 3:] + SFT_VARIANTS[:rnd % 3]
        for v in order:
            doc = _worker(a, "--sft_worker", v, "--sft_steps", a.sft_steps)
            times[v] += doc["step_s"][1:]
            tokens[v] += doc["tokens"][1:]
            info[v] = {k: doc[k] for k in ("mixed_precision", "micro_batch", "attention")}
            info[v]["peak_rss_mb"] = max(info.get(v, {}).get("peak_rss_mb", 0), doc["peak_rss_mb"])
            log(f"sft round {rnd} {v} ({doc['mixed_precision']}, micro {doc['micro_batch']}, {doc['attention']}): "
                + ", ".join(f"{x:.2f}s" for x in doc["step_s"]))
    tps = {v: sum(tokens[v]) / sum(times[v]) for v in SFT_VARIANTS}
    from generator.model import load_generator

    n_params = sum(p.numel() for p in load_generator(cfg.model)[0].parameters())
    rate = bench_matmul()["bf16_gflops"] * 1e9
    limit = rate / (4 * n_params)
    return {"variants": info, "batch_size": cfg.warmstart_batch_size, "max_length": cfg.warmstart_max_length,
            **{f"tokens_per_s_{v}": r(tps[v], 1) for v in SFT_VARIANTS},
            **{f"step_s_{v}": [r(x) for x in times[v]] for v in SFT_VARIANTS},
            "ratio": r(tps["bf16"] / tps["before"]), "ratio_bf16_vs_fp32_now": r(tps["bf16"] / tps["fp32"]),
            "ratio_fp32_now_vs_before": r(tps["fp32"] / tps["before"]),
            "limit_tokens_per_s_bf16": r(limit, 1), "share_of_limit_bf16": r(tps["bf16"] / limit, 3)}


def bench_heldout(a, cfg) -> dict:
    import _baseline_generation as before

    from adversary.heldout import HELDOUT_SEED, heldout_settings
    from adversary.stages import prepare_data
    from generator.engine import Engine, inference_copy
    from generator.model import LoraSettings, load_generator
    from generator.prompts import render_prompt
    from generator.sample import simulate_records

    if a.heldout_contexts:
        cfg.heldout_contexts = a.heldout_contexts
    data = prepare_data(cfg, 0)
    model, tok = load_generator(cfg.model, lora=LoraSettings(r=cfg.lora_r or 16, alpha=cfg.lora_alpha))
    s = heldout_settings(cfg)
    prompts = [render_prompt(tok, rec.context, max_context_tokens=s.max_prompt_tokens) for rec in data.heldout]

    def old():
        fp32 = inference_copy(model, "fp32")
        out = before.generate_texts(fp32, tok, prompts, max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                                    top_p=s.top_p, seed=HELDOUT_SEED, batch_size=BEFORE_SIM_BATCH_SIZE)
        return sum(len(tok(t, add_special_tokens=False)["input_ids"]) + (0 if hit else 1) for t, hit in out)

    def new():
        engine = Engine(inference_copy(model, cfg.dtype), tok, batch_size=cfg.sim_batch_size, precision=cfg.dtype)
        out = engine.complete_texts(prompts, s, seed=HELDOUT_SEED)
        return sum(len(c.ids) for c in out)

    new()  # warm-up of both paths (kernel choice, the tokenizer's caches)
    old()
    res = {"before": [], "engine": []}
    toks = {"before": [], "engine": []}
    for rep in range(a.heldout_repeats):
        for name, fn in (("before", old), ("engine", new)) if rep % 2 == 0 else (("engine", new), ("before", old)):
            t0 = time.perf_counter()
            n = fn()
            dt = time.perf_counter() - t0
            res[name].append(dt)
            toks[name].append(n)
            log(f"heldout {name}: {dt:.1f}s, {n} tokens ({n / dt:.0f} tok/s)")
    tps = {k: sum(toks[k]) / sum(res[k]) for k in res}
    return {"contexts": len(prompts), "max_new_tokens": s.max_new_tokens, "max_prompt_tokens": s.max_prompt_tokens,
            "batch_size_before": BEFORE_SIM_BATCH_SIZE, "batch_size": cfg.sim_batch_size, "precision": cfg.dtype,
            "seconds_before": [r(x, 1) for x in res["before"]], "seconds_engine": [r(x, 1) for x in res["engine"]],
            "tokens_per_s_before": r(tps["before"], 1), "tokens_per_s_engine": r(tps["engine"], 1),
            "ratio": r(tps["engine"] / tps["before"])}


GRPO_VARIANTS = ("before", "fp32", "bf16")


def grpo_worker(a) -> int:
    """One process: the preset's GRPO steps in one variant (`adversary.loop.grpo_trainer`, a constant reward,
    completions forced to the full `max_completion_length` so every variant does the same work); prints the step
    times as JSON. `before`: fp32 and TRL as it comes (its `generate`, sdpa, its fused head over every position)."""
    from transformers import TrainerCallback

    from adversary.loop import grpo_dataset, grpo_trainer
    from adversary.stages import prepare_data
    from adversary.train import quiet_libraries
    from generator.model import load_generator

    variant = a.grpo_worker
    cfg, args = job_config(a, "--dtype", "fp32" if variant in ("before", "fp32") else "bf16",
                           "--max_steps", str(a.grpo_steps), "--logging_steps", "1000")
    quiet_libraries()
    args.generation_kwargs = {**(args.generation_kwargs or {}), "min_new_tokens": args.max_completion_length}
    data = prepare_data(cfg, args.seed)
    model, tok = load_generator(cfg.model)
    times, t0 = [], [0.0]

    class Timer(TrainerCallback):
        def on_step_begin(self, *x, **k):
            t0[0] = time.perf_counter()

        def on_step_end(self, *x, **k):
            times.append(time.perf_counter() - t0[0])

    trainer = grpo_trainer(cfg, args, model, tok, grpo_dataset(cfg, tok, data.grpo),
                           [lambda prompts, completions, **k: [0.0] * len(completions)], [Timer()],
                           prepare=variant != "before")
    trainer.train()
    print(json.dumps({"variant": variant, "mixed_precision": trainer.accelerator.mixed_precision,
                      "rollout": "engine" if trainer.rollout_func is not None else "trl", "step_s": times}))
    return 0


def bench_grpo(a, cfg) -> dict:
    times = {v: [] for v in GRPO_VARIANTS}
    info = {}
    for rnd in range(a.grpo_rounds):
        for v in GRPO_VARIANTS[rnd % 3:] + GRPO_VARIANTS[:rnd % 3]:
            doc = _worker(a, "--grpo_worker", v, "--grpo_steps", a.grpo_steps)
            times[v] += doc["step_s"][1:]
            info[v] = {"mixed_precision": doc["mixed_precision"], "rollout": doc["rollout"]}
            log(f"grpo round {rnd} {v} ({doc['mixed_precision']}, {doc['rollout']}): "
                + ", ".join(f"{x:.2f}" for x in doc["step_s"]))
    med = {v: median(times[v]) for v in GRPO_VARIANTS}
    return {"variants": info, **{f"step_s_{v}": [r(x) for x in times[v]] for v in GRPO_VARIANTS},
            **{f"median_step_s_{v}": r(med[v]) for v in GRPO_VARIANTS},
            "ratio": r(med["bf16"] / med["before"]), "ratio_bf16_vs_fp32_now": r(med["bf16"] / med["fp32"])}


def main(argv=None) -> int:
    a = parse(argv)
    if a.grpo_worker:
        return grpo_worker(a)
    if a.sft_worker:
        return sft_worker(a)
    from adversary.train import quiet_libraries
    from conversations.precision import cpu_bf16_is_fast

    quiet_libraries()
    cfg, args = job_config(a)
    out = {"bench": "precision", "config": str(Path(a.config).name), "model": cfg.model, "precision": cfg.dtype,
           "cpu_bf16_fast": cpu_bf16_is_fast()}
    for part in a.only:
        log(f"== {part}")
        out[part] = {"matmul": lambda: bench_matmul(), "sft": lambda: bench_sft(a, cfg),
                     "heldout": lambda: bench_heldout(a, cfg), "grpo": lambda: bench_grpo(a, cfg)}[part]()
    targets = {"sft": ("ratio", 2.0, ">="), "heldout": ("ratio", 3.0, ">="), "grpo": ("ratio", 0.5, "<=")}
    out["targets"] = {k: {"figure": f"{k}.{key}", "target": f"{op} {v}",
                          "meets": (out[k].get(key, 0) >= v) if op == ">=" else (out[k].get(key, 9) <= v)}
                      for k, (key, v, op) in targets.items() if k in out and key in out[k]}
    emit(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
