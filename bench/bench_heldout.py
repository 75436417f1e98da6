"""Held-out generation: the simulation half of one held-out td evaluation, the engine's speed-ups added one at a time
against the path before the engine, measured in one process run.

    python bench/bench_heldout.py            # the demo preset: SmolLM2-135M + LoRA r=16, its held-out contexts
    python bench/bench_heldout.py --tiny     # the tiny random model (a fast check of the benchmark itself)
    python bench/bench_heldout.py --model runs/demo/warmstart/merged   # a warm-started simulator (it ends its turns)

The generator is the preset's model with a LoRA adapter on every linear layer (lora_B drawn at random, so that the
adapter changes the outputs, as a trained one does); the contexts and lengths are the preset's held-out ones
(`heldout_contexts`, `max_context_tokens`, `heldout_max_new_tokens`, `sim_batch_size`). The variants, in order:

1. `before`: the path before the engine (`_baseline_generation.py`): transformers' `generate` over an fp32 merged copy,
   the shared system-prompt cache and the one-level nucleus sampler of that time;
2. `engine_fp32`: the engine on the fp32 merged copy, every option off (left padding, full rows, concatenating cache);
3. `+shared_prefix`: the system prompt's key/value cache computed once per batch;
4. `+compaction`: finished rows leave the batch (a quarter of the rows done at a time);
5. `+growing_cache`: keys and values written into reserved room instead of concatenated;
6. `+bf16_copy`: the merged copy in the run's precision (bf16 where this CPU is fast at it) — the main job's path.
Each variant runs `--repeats` times, in rotating order; tokens/s of generated tokens, best time, ratio to `before`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, emit, log, r  # noqa: E402

VARIANTS = ("before", "engine_fp32", "+shared_prefix", "+compaction", "+growing_cache", "+bf16_copy")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    p.add_argument("--tiny", action="store_true", help="tiny-random generator (fast; not the default's numbers)")
    p.add_argument("--model", default=None, help="the simulator's weights (default: the preset's model)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    import torch
    from peft import get_peft_model

    import _baseline_generation as baseline

    from adversary.heldout import HELDOUT_SEED, heldout_settings
    from adversary.stages import prepare_data
    from adversary.train import parse_args, quiet_libraries
    from generator.engine import Engine, inference_copy
    from generator.model import load_generator, lora_config
    from generator.prompts import render_prompt

    overrides = ["--model", "tiny-random"] if a.tiny else ["--model", a.model] if a.model else []
    cfg, args = parse_args(["--config", a.config, "--output_dir", "/tmp/bench_heldout", *overrides])
    quiet_libraries()
    data = prepare_data(cfg, args.seed)
    base, tok = load_generator(cfg.model)
    model = get_peft_model(base, lora_config(cfg.lora_r or 16, cfg.lora_alpha))
    with torch.no_grad():
        g = torch.Generator().manual_seed(a.seed)
        for n, w in model.named_parameters():
            if "lora_B" in n:
                w.copy_(torch.randn(w.shape, generator=g) * 1e-3)
    s = heldout_settings(cfg)
    prompts = [render_prompt(tok, rec.context, max_context_tokens=s.max_prompt_tokens) for rec in data.heldout]
    log(f"{cfg.model}: {len(prompts)} held-out contexts, <= {s.max_prompt_tokens} prompt tokens, <= {s.max_new_tokens} "
        f"new tokens, batches of {cfg.sim_batch_size}, precision {cfg.dtype}, torch threads {torch.get_num_threads()}")

    def run(variant: str) -> tuple[float, int]:
        i = VARIANTS.index(variant)
        t0 = time.perf_counter()
        if i == 0:
            out = baseline.generate_texts(inference_copy(model, "fp32"), tok, prompts, max_new_tokens=s.max_new_tokens,
                                          temperature=s.temperature, top_p=s.top_p, seed=HELDOUT_SEED,
                                          batch_size=cfg.sim_batch_size)
            n = sum(len(tok(t, add_special_tokens=False)["input_ids"]) + (0 if hit else 1) for t, hit in out)
        else:
            engine = Engine(inference_copy(model, cfg.dtype if i >= 5 else "fp32"), tok, batch_size=cfg.sim_batch_size,
                            share_prefix=i >= 2, compact=i >= 3, growing_cache=i >= 4)
            n = sum(len(c.ids) for c in engine.complete_texts(prompts, s, seed=HELDOUT_SEED))
        return time.perf_counter() - t0, n

    run("+bf16_copy")  # warm-up
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    tokens: dict[str, list[int]] = {v: [] for v in VARIANTS}
    for rep in range(a.repeats):
        order = VARIANTS[rep % len(VARIANTS):] + VARIANTS[: rep % len(VARIANTS)]
        for v in order:
            dt, n = run(v)
            times[v].append(dt)
            tokens[v].append(n)
            log(f"  {v:16s} {dt:.2f}s {n} tokens ({n / dt:.0f} tok/s)")
    tps = {v: max(n / t for n, t in zip(tokens[v], times[v])) for v in VARIANTS}
    emit({
        "bench": "heldout_generation",
        "config": a.config,
        "tiny": a.tiny,
        "model": cfg.model,
        "precision": cfg.dtype,
        "contexts": len(prompts),
        "max_new_tokens": s.max_new_tokens,
        "seconds": {v: [r(x) for x in t] for v, t in times.items()},
        "tokens": tokens,
        "best_tokens_per_s": {v: r(x, 1) for v, x in tps.items()},
        "speedup_vs_before": {v: r(x / tps["before"]) for v, x in tps.items()},
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
