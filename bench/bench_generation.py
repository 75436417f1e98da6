"""Generation throughput: the simulator's batched sampling against plain one-prompt-at-a-time `generate`, and both
against the machine's arithmetic limit, measured in one process run.

    python bench/bench_generation.py            # SmolLM2-135M, 32 held-out contexts, 48 new tokens, batches of 16
    python bench/bench_generation.py --tiny     # the tiny random model (a fast check of the benchmark itself)

- batched: `generator.sample.user_turns(Engine(model, tok, batch_size=B), contexts, settings)` (the generation engine:
  batches; a batch runs until its longest turn ends, so padding and finished rows cost time and count as nothing);
- serial: `model.generate` on one rendered prompt at a time, same prompts, sampling settings and stop tokens;
- tokens: the useful generated tokens, counted the same way for both (the turn's tokens, plus the end-of-turn
  token where the turn ended before the limit);
- arithmetic limit: 2 x parameters FLOPs per generated token (a forward pass; prompt tokens not counted) against
  the best fp32 torch.matmul FLOP/s measured in the same run (square matrices, `--matmul_n`), measured before and
  after the generation runs. `arith_fraction` = tokens/s x 2 x params / matmul FLOP/s.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, log, median, r  # noqa: E402


def matmul_flops(n: int, seconds: float = 2.0) -> tuple[float, float]:
    """(best, median) FLOP/s of an n x n fp32 matmul on the current torch threads, over ~`seconds`."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        torch.mm(a, b)
    rates = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(rates) < 5:
        t0 = time.perf_counter()
        torch.mm(a, b)
        dt = time.perf_counter() - t0
        rates.append(2 * n**3 / dt)
    return max(rates), median(rates)


def useful_tokens(tokenizer, texts: list[str], max_new_tokens: int) -> int:
    n = 0
    for t in texts:
        k = len(tokenizer(t, add_special_tokens=False)["input_ids"])
        n += min(max_new_tokens, k + 1) if k < max_new_tokens else max_new_tokens  # +1: the end-of-turn token
    return n


def serial_generate(model, tokenizer, prompts: list[str], *, max_new_tokens: int, temperature: float, top_p: float,
                    seed: int) -> list[str]:
    """Plain transformers generate, one prompt at a time (no batching, no padding)."""
    import torch

    from generator.engine import stop_token_ids
    from generator.sample import clean_turn

    stops = stop_token_ids(tokenizer, model)
    stop_set = set(stops)
    out = []
    model.eval()
    with torch.inference_mode():
        torch.manual_seed(seed)
        for p in prompts:
            ids = torch.tensor([tokenizer(p, add_special_tokens=False)["input_ids"]])
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=True, temperature=temperature, top_p=top_p, top_k=0, eos_token_id=stops,
                                 pad_token_id=tokenizer.pad_token_id)
            row = gen[0, ids.shape[1]:].tolist()
            cut = next((k for k, t in enumerate(row) if t in stop_set), None)
            out.append(clean_turn(tokenizer.decode(row[:cut] if cut is not None else row, skip_special_tokens=True)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tiny", action="store_true", help="use the tiny-random model")
    p.add_argument("--contexts", type=int, default=32)
    p.add_argument("--max_new_tokens", type=int, default=48)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--max_context_tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top_p", type=float, default=0.95)
    p.add_argument("--repeats", type=int, default=2, help="timed repeats of each mode (alternating); the best counts")
    p.add_argument("--matmul_n", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    model_name = "tiny-random" if a.tiny else a.model

    import torch

    from generator.data import load_turns, sample_records
    from generator.model import load_generator
    from generator.engine import Engine, SamplingSettings
    from generator.prompts import render_prompt
    from generator.sample import user_turns

    model, tok = load_generator(model_name)
    model.eval()
    params = sum(p.numel() for p in model.parameters())
    records = sample_records([x for x in load_turns("sharegpt", "test", max_context_messages=2, max_turn_chars=300)
                              if x.user_turn.strip()], a.contexts, seed=a.seed)
    contexts = [x.context for x in records]
    prompts = [render_prompt(tok, c, max_context_tokens=a.max_context_tokens) for c in contexts]
    prompt_tokens = sum(len(tok(q, add_special_tokens=False)["input_ids"]) for q in prompts)
    log(f"{model_name}: {params / 1e6:.1f}M parameters, {len(contexts)} contexts ({prompt_tokens} prompt tokens), "
        f"{a.max_new_tokens} new tokens max, torch threads {torch.get_num_threads()}")

    flops_before = matmul_flops(a.matmul_n)
    kw = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p)
    settings = SamplingSettings(**kw, max_prompt_tokens=a.max_context_tokens)
    engine = Engine(model, tok, batch_size=a.batch_size)  # the same fp32 weights as the serial path
    user_turns(engine, contexts[:2], settings, seed=a.seed)  # warm-up
    runs = {"batched": [], "serial": []}
    for rep in range(a.repeats):
        order = ["batched", "serial"] if rep % 2 == 0 else ["serial", "batched"]
        for mode in order:
            t0 = time.perf_counter()
            if mode == "batched":
                texts = [t.text for t in user_turns(engine, contexts, settings, seed=a.seed + rep)]
            else:
                texts = serial_generate(model, tok, prompts, seed=a.seed + rep, **kw)
            dt = time.perf_counter() - t0
            n = useful_tokens(tok, texts, a.max_new_tokens)
            runs[mode].append({"seconds": dt, "tokens": n, "tokens_per_s": n / dt})
            log(f"  {mode:7s} repeat {rep}: {n} tokens in {dt:.1f}s = {n / dt:.1f} tok/s")
    flops_after = matmul_flops(a.matmul_n)
    peak = max(flops_before[0], flops_after[0])

    def best(mode):
        return max(runs[mode], key=lambda x: x["tokens_per_s"])

    b, s = best("batched"), best("serial")
    emit({
        "bench": "generation",
        "model": model_name,
        "parameters": params,
        "contexts": len(contexts),
        "prompt_tokens": prompt_tokens,
        "max_new_tokens": a.max_new_tokens,
        "batch_size": a.batch_size,
        "repeats": a.repeats,
        "batched_tokens_per_s": r(b["tokens_per_s"], 1),
        "serial_tokens_per_s": r(s["tokens_per_s"], 1),
        "batched_over_serial": r(b["tokens_per_s"] / s["tokens_per_s"], 2),
        "batched_runs": [{k: r(v, 2) for k, v in x.items()} for x in runs["batched"]],
        "serial_runs": [{k: r(v, 2) for k, v in x.items()} for x in runs["serial"]],
        "matmul_n": a.matmul_n,
        "matmul_gflops_best": r(peak / 1e9, 1),
        "matmul_gflops_median": [r(flops_before[1] / 1e9, 1), r(flops_after[1] / 1e9, 1)],
        "flops_per_token": 2 * params,
        "arith_fraction_batched": r(b["tokens_per_s"] * 2 * params / peak, 4),
        "arith_fraction_serial": r(s["tokens_per_s"] * 2 * params / peak, 4),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
