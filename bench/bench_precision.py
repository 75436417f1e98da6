"""Throughput by precision and path, on this machine, at the demo preset's shapes (issue: throughput).

    python bench/bench_precision.py                 # everything below, SmolLM2-135M, the demo preset
    python bench/bench_precision.py --only sft      # one part: matmul | sft | heldout | grpo

- **matmul**: GFLOP/s of a 1024 x 1024 matmul in fp32 and under bf16 autocast (best of 8), the arithmetic limit.
- **sft**: LoRA SFT steps (r and alpha of the preset, every linear layer) on the warm start's real batches (micro-
  batch x accumulation, prompts up to `max_context_tokens`, sequences up to `warmstart_max_length`), forward +
  backward + AdamW, fp32 against bf16 autocast (what TRL's `bf16=True` does on a CPU), steps interleaved in one
  process. Tokens/s count the non-pad tokens; the limit is the bf16 matmul rate over 4 x params FLOPs a token
  (forward 2N, gradients of the activations 2N; LoRA's own weight gradients are negligible).
- **heldout**: one held-out evaluation's simulation (the preset's held-out contexts, prompt budget and token
  budget) by the path before the engine (`_baseline_generation.py`: transformers' `generate` over an fp32 merged
  copy, shared system-prompt cache, one-level nucleus sampler, batches of `sim_batch_size`) against the engine on the
  inference copy of the run's precision, interleaved in one process; tokens/s of generated tokens.
- **grpo**: the preset's GRPO step (TRL GRPOTrainer, a constant reward, completions forced to the full
  `max_completion_length` so both do the same work) in fp32 and in the run's precision. accelerate fixes the mixed
  precision once per process, so each variant runs in its own subprocess, alternating fp32, bf16, fp32, bf16; the
  first step of each process is dropped.

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
    p.add_argument("--sft_steps", type=int, default=4, help="measured SFT steps per variant (after 1 warm-up)")
    p.add_argument("--heldout_repeats", type=int, default=2, help="held-out simulations per variant")
    p.add_argument("--heldout_contexts", type=int, default=None, help="default: the preset's heldout_contexts")
    p.add_argument("--grpo_steps", type=int, default=4, help="GRPO steps per process (the first is dropped)")
    p.add_argument("--grpo_rounds", type=int, default=2, help="fp32/bf16 process pairs")
    p.add_argument("--model", default=None, help="simulator weights (default: the preset's model)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="preset keys to override (e.g. heldout_max_new_tokens=96)")
    p.add_argument("--grpo_worker", default=None, help=argparse.SUPPRESS)
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


def bench_sft(a, cfg) -> dict:
    import torch

    from adversary.stages import prepare_data
    from generator.data import sample_records
    from generator.model import LoraSettings, load_generator
    from generator.sft import encode_example, sft_examples

    data = prepare_data(cfg, 0)
    micro, accum = cfg.warmstart_micro_batch, cfg.warmstart_batch_size // cfg.warmstart_micro_batch
    steps = a.sft_steps + 1
    records = sample_records(data.train, steps * 2 * cfg.warmstart_batch_size, seed=0)
    torch.manual_seed(0)
    model, tok = load_generator(cfg.model, lora=LoraSettings(r=cfg.lora_r or 16, alpha=cfg.lora_alpha, dropout=0.0))
    examples, _ = sft_examples(records, tok, max_context_tokens=cfg.max_context_tokens, max_length=cfg.warmstart_max_length)
    encoded = [encode_example(tok, ex) for ex in examples]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    model.train()

    def batches(i):  # the i-th optimiser step's micro-batches
        for k in range(accum):
            rows = encoded[(i * accum + k) * micro:(i * accum + k + 1) * micro]
            T = max(len(ids) for ids, _ in rows)
            ids = torch.tensor([x + [tok.pad_token_id] * (T - len(x)) for x, _ in rows])
            attn = torch.tensor([[1] * len(x) + [0] * (T - len(x)) for x, _ in rows])
            labels = torch.tensor([[t if m else -100 for t, m in zip(x, mk)] + [-100] * (T - len(x)) for x, mk in rows])
            yield ids, attn, labels, int(attn.sum())

    def step(i, bf16):
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else torch.autocast("cpu", enabled=False)
        t0, n = time.perf_counter(), 0
        for ids, attn, labels, tokens in batches(i):
            with ctx:
                loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss / accum
            loss.backward()
            n += tokens
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, n

    times = {"fp32": [], "bf16": []}
    tokens = {"fp32": [], "bf16": []}
    for i in range(steps):  # interleaved: fp32 then bf16 on the same step's batches
        for name in ("fp32", "bf16"):
            dt, n = step(i, name == "bf16")
            if i:  # the first step of each is a warm-up
                times[name].append(dt)
                tokens[name].append(n)
            log(f"sft step {i} {name}: {dt:.2f}s, {n} tokens")
    tps = {k: sum(tokens[k]) / sum(times[k]) for k in times}
    n_params = sum(p.numel() for p in model.parameters())
    rate = bench_matmul()["bf16_gflops"] * 1e9
    limit = rate / (4 * n_params)
    return {"micro_batch": micro, "accumulation": accum, "max_length": cfg.warmstart_max_length,
            "step_s_fp32": [r(x) for x in times["fp32"]], "step_s_bf16": [r(x) for x in times["bf16"]],
            "tokens_per_s_fp32": r(tps["fp32"], 1), "tokens_per_s_bf16": r(tps["bf16"], 1),
            "ratio": r(tps["bf16"] / tps["fp32"]), "limit_tokens_per_s_bf16": r(limit, 1),
            "share_of_limit_bf16": r(tps["bf16"] / limit, 3)}


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
                                    top_p=s.top_p, seed=HELDOUT_SEED, batch_size=cfg.sim_batch_size)
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
            "batch_size": cfg.sim_batch_size, "precision": cfg.dtype,
            "seconds_before": [r(x, 1) for x in res["before"]], "seconds_engine": [r(x, 1) for x in res["engine"]],
            "tokens_per_s_before": r(tps["before"], 1), "tokens_per_s_engine": r(tps["engine"], 1),
            "ratio": r(tps["engine"] / tps["before"])}


def grpo_worker(a) -> int:
    """One process: the preset's GRPO steps in one precision; prints the step times as JSON."""
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from adversary.loop import grpo_dataset
    from adversary.stages import prepare_data
    from adversary.train import quiet_libraries
    from generator.model import load_generator, lora_config

    cfg, args = job_config(a, "--dtype", a.grpo_worker, "--max_steps", str(a.grpo_steps), "--logging_steps", "1000")
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

    trainer = GRPOTrainer(model=model, reward_funcs=[lambda prompts, completions, **k: [0.0] * len(completions)],
                          args=args, train_dataset=grpo_dataset(cfg, tok, data.grpo), processing_class=tok,
                          peft_config=lora_config(cfg.lora_r, cfg.lora_alpha), callbacks=[Timer()])
    trainer.train()
    print(json.dumps({"precision": cfg.dtype, "mixed_precision": trainer.accelerator.mixed_precision, "step_s": times}))
    return 0


def bench_grpo(a, cfg) -> dict:
    times = {"fp32": [], cfg.dtype: []}
    if cfg.dtype == "fp32":
        return {"skipped": "the run's precision is fp32 on this machine: nothing to compare"}
    for rnd in range(a.grpo_rounds):
        for dtype in ("fp32", cfg.dtype):
            cmd = [sys.executable, __file__, "--config", a.config, "--grpo_worker", dtype, "--grpo_steps", str(a.grpo_steps),
                   "--set", *a.set]
            if a.model:
                cmd += ["--model", a.model]
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
            if out.returncode:
                raise RuntimeError(f"GRPO worker ({dtype}) failed: {out.stderr.strip().splitlines()[-1:]}")
            doc = json.loads(out.stdout.strip().splitlines()[-1])
            times[dtype] += doc["step_s"][1:]
            log(f"grpo round {rnd} {dtype} ({doc['mixed_precision']}): " + ", ".join(f"{x:.2f}" for x in doc["step_s"]))
    med = {k: median(v) for k, v in times.items()}
    return {"step_s_fp32": [r(x) for x in times["fp32"]],
            f"step_s_{cfg.dtype}": [r(x) for x in times[cfg.dtype]], "median_step_s_fp32": r(med["fp32"]),
            f"median_step_s_{cfg.dtype}": r(med[cfg.dtype]), "ratio": r(med[cfg.dtype] / med["fp32"])}


def main(argv=None) -> int:
    a = parse(argv)
    if a.grpo_worker:
        return grpo_worker(a)
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
