"""Held-out generation: the simulation half of one held-out td evaluation, as the main job did it before each speed-up
and as it does it now, measured in one process run.

    python bench/bench_heldout.py            # the demo preset: SmolLM2-135M + LoRA r=16, 64 held-out contexts
    python bench/bench_heldout.py --tiny     # the tiny random model (a fast check of the benchmark itself)

The generator is the preset's model with a LoRA adapter on every linear layer (lora_B drawn at random, so that the
adapter changes the outputs, as a trained one does); the contexts are the preset's held-out contexts and lengths
(`heldout_contexts`, `max_context_tokens`, `heldout_max_new_tokens`). The variants add one change each, in order:

1. `before`: the LoRA model as the trainer holds it, prompts left-padded, transformers' sampling, batches of 32;
2. `merged`: a merged copy of the LoRA model (`adversary.heldout.generation_model`);
3. `shared_prefix`: the system prompt's key/value cache computed once per batch (`generator.sample.prefix_cache_batch`);
4. `nucleus_sampler`: `generator.sample.NucleusSampler` instead of transformers' sort + multinomial;
5. `batch_64`: the preset's `sim_batch_size` (all contexts in one call) — what the main job runs now.

Each variant runs `--repeats` times, in rotating order; the best time counts. Speed-ups are ratios to `before`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, emit, log, r  # noqa: E402

VARIANTS = ("before", "merged", "shared_prefix", "nucleus_sampler", "batch_64")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    p.add_argument("--tiny", action="store_true", help="tiny-random generator (fast; not the default's numbers)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    import torch
    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model

    from adversary.heldout import generation_model, simulate_heldout
    from adversary.stages import prepare_data
    from adversary.train import parse_args, quiet_libraries
    from generator.model import load_generator

    overrides = ["--model", "tiny-random"] if a.tiny else []
    cfg, args = parse_args(["--config", a.config, "--output_dir", "/tmp/bench_heldout", *overrides])
    quiet_libraries()
    data = prepare_data(cfg, args.seed)
    base, tok = load_generator(cfg.model)
    model = get_peft_model(base, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules="all-linear",
                                            task_type="CAUSAL_LM"))
    with torch.no_grad():
        g = torch.Generator().manual_seed(a.seed)
        for n, w in model.named_parameters():
            if "lora_B" in n:
                w.copy_(torch.randn(w.shape, generator=g) * 1e-3)
    acc = Accelerator(cpu=True)
    n_ctx = len(data.heldout)
    log(f"{cfg.model}: {n_ctx} held-out contexts, <= {cfg.max_context_tokens} prompt tokens, <= "
        f"{cfg.heldout_max_new_tokens} new tokens, torch threads {torch.get_num_threads()}")

    def run(variant: str) -> float:
        i = VARIANTS.index(variant)
        cfg.sim_batch_size = 64 if i >= 4 else 32
        kw = dict(share_prefix=i >= 2, fast_sampling=i >= 3)
        t0 = time.perf_counter()
        with generation_model(model, acc, merge_lora=i >= 1) as gen:
            simulate_heldout(gen, tok, data.heldout, cfg, **kw)
        return time.perf_counter() - t0

    run("batch_64")  # warm-up
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rep in range(a.repeats):
        order = VARIANTS[rep % len(VARIANTS):] + VARIANTS[: rep % len(VARIANTS)]
        for v in order:
            times[v].append(run(v))
            log(f"  {v:16s} {times[v][-1]:.2f}s")
    best = {v: min(t) for v, t in times.items()}
    emit({
        "bench": "heldout_generation",
        "config": a.config,
        "tiny": a.tiny,
        "model": cfg.model,
        "contexts": n_ctx,
        "max_new_tokens": cfg.heldout_max_new_tokens,
        "seconds": {v: [r(x) for x in t] for v, t in times.items()},
        "best_seconds": {v: r(x) for v, x in best.items()},
        "speedup_vs_before": {v: r(best["before"] / x) for v, x in best.items()},
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
