"""The sampler of the engine against the one before it, on logits the engine produced (issue: throughput).

    python bench/bench_sampler.py                 # SmolLM2-135M, the demo preset's held-out settings
    python bench/bench_sampler.py --tiny          # the tiny random model: every row flat (the tests' sampler)

The engine simulates the preset's first `--contexts` held-out contexts in batches of the preset's `sim_batch_size`
and every `--every`-th sampler input (the logits of one decoding step, (rows, vocab)) is kept. On those logits,
interleaved call by call: `generator.engine.NucleusSampler` (the nucleus among the tokens above probability floors)
and `TopKCandidates` (the engine's sampler before: the nucleus among `topk(256)`, then `topk(4096)`, then a full
sort), and the floors without the cut by value of flat rows (`FLAT`: what the tiny random model's rows take).
Reported: ms a call (median over the calls of the sum of `--repeats` timings), the ratios, the nucleus sizes over
every kept row, how many rows each of the new sampler's floors served and how many were flat. Prints one JSON line."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, emit, log, median, r  # noqa: E402


class TopKCandidates:
    """The engine's sampler before the floors (kept here as the baseline): the nucleus looked for among the top
    256 logits, then 4,096 for the rows it did not fit, then a full sort; Gumbel-max draw over the nucleus."""

    def __init__(self, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, sizes=(256, 4096)):
        self.temperature, self.top_p, self.top_k, self.sizes = temperature, top_p, top_k, tuple(sorted(sizes))

    def __call__(self, scores):
        """scores (B, V) -> sampled token ids (B,)."""
        import torch

        scores = scores.float()  # (B, V)
        if self.temperature != 1:
            scores = scores / self.temperature
        V = scores.shape[-1]
        if self.top_p >= 1 and not self.top_k:  # the whole vocabulary: no nucleus to find
            return (scores - torch.empty_like(scores).exponential_().log()).argmax(-1)
        out = torch.empty(scores.shape[0], dtype=torch.long, device=scores.device)
        rows = torch.arange(scores.shape[0], device=scores.device)
        # probabilities in the full distribution, or, with top_k, in the top-k one (transformers' top-p after top-k)
        norm = None if self.top_k else scores.logsumexp(-1, keepdim=True)  # (B, 1)
        sizes = [min(self.top_k, V)] if self.top_k else [c for c in self.sizes if c < V] + [V]
        for k in sizes:
            sub = scores if len(rows) == scores.shape[0] else scores[rows]  # no (B, V) copy on the first pass
            vals, idx = sub.topk(k, dim=-1) if k < V else sub.sort(dim=-1, descending=True)  # (b, k), descending
            probs = (vals - (vals.logsumexp(-1, keepdim=True) if self.top_k else norm[rows])).exp()  # (b, k)
            keep = (probs.cumsum(-1) - probs) < self.top_p  # the mass ranked above each candidate
            keep[:, 0] = True
            fits = (probs.sum(-1) >= self.top_p) | (k >= V) | bool(self.top_k)  # the nucleus ends inside the candidates
            if fits.any():
                v, i, kp = vals[fits], idx[fits], keep[fits]
                noisy = torch.where(kp, v - torch.empty_like(v).exponential_().log(), float("-inf"))
                out[rows[fits]] = i.gather(-1, noisy.argmax(-1, keepdim=True)).squeeze(-1)
            rows = rows[~fits]
            if not len(rows):
                break
        return out


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    p.add_argument("--contexts", type=int, default=128, help="held-out contexts simulated to capture logits")
    p.add_argument("--every", type=int, default=4, help="keep every n-th sampler input")
    p.add_argument("--repeats", type=int, default=3, help="timed calls of each sampler per kept input")
    p.add_argument("--tiny", action="store_true", help="the tiny random model")
    return p.parse_args(argv)


def capture(a):
    """(kept sampler inputs, settings): the engine's logits over the preset's held-out contexts."""
    from adversary.heldout import HELDOUT_SEED, heldout_settings
    from adversary.stages import prepare_data
    from adversary.train import parse_args, quiet_libraries
    from generator import engine as engine_mod
    from generator.engine import Engine, inference_copy
    from generator.model import LoraSettings, load_generator
    from generator.prompts import render_prompt

    quiet_libraries()
    over = ["--output_dir", str(ROOT / "outputs" / "bench_sampler"), "--report_to", "none", "--heldout_contexts", str(a.contexts)]
    if a.tiny:
        over += ["--model", "tiny-random", "--discriminator", "tiny-random-encoder"]
    cfg, _ = parse_args(["--config", a.config, *over])
    data = prepare_data(cfg, 0)
    model, tok = load_generator(cfg.model, lora=LoraSettings(r=cfg.lora_r or 16, alpha=cfg.lora_alpha))
    s = heldout_settings(cfg)
    prompts = [render_prompt(tok, rec.context, max_context_tokens=s.max_prompt_tokens) for rec in data.heldout]
    kept, seen = [], [0]
    draw = engine_mod.NucleusSampler.__call__

    def keeping(self, scores):
        if seen[0] % a.every == 0:
            kept.append(scores.clone())
        seen[0] += 1
        return draw(self, scores)

    engine_mod.NucleusSampler.__call__ = keeping
    try:
        Engine(inference_copy(model, cfg.dtype), tok, batch_size=cfg.sim_batch_size, precision=cfg.dtype).complete_texts(
            prompts, s, seed=HELDOUT_SEED)
    finally:
        engine_mod.NucleusSampler.__call__ = draw
    log(f"kept {len(kept)} of {seen[0]} sampler inputs, rows {sorted({k.shape[0] for k in kept})}, {kept[0].dtype}")
    return kept, s


def main(argv=None) -> int:
    a = parse(argv)
    kept, s = capture(a)
    from generator.engine import NucleusSampler

    new = NucleusSampler(s.temperature, s.top_p, s.top_k)
    old = TopKCandidates(s.temperature, s.top_p, s.top_k)
    no_cut = NucleusSampler(s.temperature, s.top_p, s.top_k)
    no_cut.FLAT = 1e-12  # every row through the floors: the sampler before flat rows were cut by value
    served = [0] * (len(new.floors) + 1)
    inner = new._draw_among_candidates

    def counting(x, norm, floor):
        fits, tok = inner(x, norm, floor)
        served[new.floors.index(floor)] += int(fits.sum())
        return fits, tok

    sizes = []
    for x in kept:  # nucleus sizes, by a full sort (not timed)
        p = x.float().div(s.temperature).softmax(-1).sort(-1, descending=True).values
        sizes += ((p.cumsum(-1) - p) < s.top_p).sum(-1).tolist()
    sizes.sort()
    new._draw_among_candidates = counting
    for x in kept:
        new(x)
    served[-1] = len(sizes) - sum(served[:-1])
    new._draw_among_candidates = inner
    times = {"topk_candidates": [], "floors": [], "floors_no_flat_cut": []}
    order = (("topk_candidates", old), ("floors", new), ("floors_no_flat_cut", no_cut))
    for i, x in enumerate(kept):
        for name, fn in order[i % 3:] + order[:i % 3]:  # rotated call by call
            fn(x)  # warm
            t0 = time.perf_counter()
            for _ in range(a.repeats):
                fn(x)
            times[name].append((time.perf_counter() - t0) / a.repeats * 1e3)
    ms = {k: median(v) for k, v in times.items()}
    q = lambda f: sizes[min(len(sizes) - 1, int(f * (len(sizes) - 1)))]  # noqa: E731
    out = {"bench": "sampler", "model": "tiny-random" if a.tiny else "preset", "calls": len(kept),
           "rows": len(sizes), "vocab": int(kept[0].shape[-1]), "top_p": s.top_p, "temperature": s.temperature,
           "nucleus_size_quantiles": {str(f): q(f) for f in (0.1, 0.5, 0.9, 0.99, 1.0)},
           "share_over_256": r(sum(1 for z in sizes if z > 256) / len(sizes), 3),
           "floors": list(new.floors), "rows_served_by_floor": served[:-1], "rows_full_sort": served[-1],
           "ms_per_call_topk_candidates": r(ms["topk_candidates"], 2), "ms_per_call_floors": r(ms["floors"], 2),
           "ratio": r(ms["floors"] / ms["topk_candidates"], 3),
           "rows_flat": sum(int(((x.float() / s.temperature).softmax(-1).amax(-1) * x.shape[-1] < new.FLAT).sum())
                            for x in kept),
           "ms_per_call_floors_no_flat_cut": r(ms["floors_no_flat_cut"], 2),
           "ratio_flat_cut": r(ms["floors"] / ms["floors_no_flat_cut"], 3)}
    emit(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
