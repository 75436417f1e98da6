"""The generation path as it was before the engine (commit d280a4d, `generator/sample.py`), kept only as the
baseline that `bench_precision.py` measures the engine against: transformers' `generate` in fp32 over a merged copy,
with the shared system-prompt cache and the one-level `NucleusSampler` of that time. Not used by the package."""

from __future__ import annotations

from typing import Any, Sequence

from generator.prompts import END_MARKER

def stop_token_ids(tokenizer, model=None) -> list[int]:
    """Token ids that end a turn: the tokenizer's and the model's eos, and every other special token (`<|im_start|>`
    opening a new turn, `<|endoftext|>`): none belongs inside a user turn."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if model is not None:
        eos = getattr(model.generation_config, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else list(eos or []))
    ids.update(int(i) for i in tokenizer.all_special_ids)
    return sorted(ids)


def _model_device(model):
    return next(model.parameters()).device


def generate_texts(
    model,
    tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_p: float = 0.95,
    top_k: int = 0,
    min_new_tokens: int = 1,
    seed: int = 0,
    batch_size: int = 16,
    share_prefix: bool = True,
    fast_sampling: bool = True,
) -> list[tuple[str, bool]]:
    """(text, hit_token_limit) for each rendered prompt, in order. Prompts are batched by length (less padding) and
    left-padded (padded after their shared prefix with `share_prefix`); generation stops at any end-of-turn token.
    The global torch RNG is left as it was.

    `share_prefix`: the tokens every prompt of a batch starts with (the simulator's system prompt: ~95 of a demo
    prompt's ~140 tokens) are run once and their key/value cache shared by the batch (`prefix_cache_batch`), which
    cuts the prefill, the larger part of generating a short turn on a CPU, by that share. `fast_sampling`: draw with
    `NucleusSampler` (the same distribution as transformers' sampling, without its full sort of the vocabulary);
    False uses transformers' own sampler."""
    import torch

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not prompts:
        return []
    device = _model_device(model)
    stops = stop_token_ids(tokenizer, model)
    stop_set = set(stops)
    enc_all = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(enc_all[i]))
    results: list[tuple[str, bool] | None] = [None] * len(prompts)
    gen_kwargs: dict[str, Any] = dict(
        max_new_tokens=max_new_tokens,
        min_new_tokens=min(min_new_tokens, max_new_tokens),
        eos_token_id=stops,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )
    sampling = bool(temperature and temperature > 0)
    if sampling and not fast_sampling:
        gen_kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
    elif sampling:
        # sampling as a greedy step over Gumbel-perturbed logits (NucleusSampler): the same distribution as
        # transformers' temperature/top-k/top-p sampling, without its full sort and multinomial over the vocabulary
        from transformers import LogitsProcessorList

        gen_kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None,
                          logits_processor=LogitsProcessorList([NucleusSampler(temperature, top_p, top_k)]))
    else:
        gen_kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)

    was_training = model.training
    model.eval()
    devices = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.inference_mode():
            torch.manual_seed(seed)
            for start in range(0, len(order), batch_size):
                idx = order[start : start + batch_size]
                rows = [enc_all[i] for i in idx]
                shared = prefix_cache_batch(model, rows, tokenizer.pad_token_id, device) if share_prefix else None
                if shared is not None:
                    input_ids, attention_mask, cache_kwargs = shared
                else:
                    batch = tokenizer.pad({"input_ids": rows}, padding=True, padding_side="left", return_tensors="pt")
                    input_ids, attention_mask, cache_kwargs = batch["input_ids"], batch["attention_mask"], {}
                input_ids = input_ids.to(device)  # (B, T_prompt)
                out = model.generate(
                    input_ids=input_ids, attention_mask=attention_mask.to(device), **cache_kwargs, **gen_kwargs
                )
                new = out[:, input_ids.shape[1] :].tolist()  # (B, T_new)
                for i, row in zip(idx, new):
                    cut = next((k for k, t in enumerate(row) if t in stop_set), None)
                    hit_limit = cut is None
                    text = tokenizer.decode(row[:cut] if cut is not None else row, skip_special_tokens=True)
                    results[i] = (text, hit_limit)
    finally:
        if was_training:
            model.train()
    return results  # type: ignore[return-value]


class NucleusSampler:
    """A transformers logits processor that samples: returns scores that are 0 at one token and -inf elsewhere, so
    the greedy step picks it. The token is drawn from exactly the distribution of transformers' temperature, top-k,
    top-p sampling (`TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`, then multinomial): the nucleus
    (the tokens whose higher-ranked tokens hold less than `top_p` of the probability) is found among the top
    `candidates` tokens (4096 held 96% of SmolLM2's nuclei at top_p 0.95 after the warm start; the median nucleus
    was 134 tokens), with a full sort only for a row whose nucleus is wider, and the draw is the Gumbel-max trick,
    argmax(logit - log E) with E ~ Exp(1). Why: transformers' full sort of 49k logits and `multinomial` took 27% of a
    batched decoding step of SmolLM2 on 2 CPU cores (90 ms a step for 32 rows; this: 18 ms). Draws use the global
    torch RNG (seeded by the caller)."""

    def __init__(self, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, candidates: int = 4096):
        if temperature <= 0 or not 0 < top_p <= 1 or top_k < 0 or candidates < 1:
            raise ValueError(f"need temperature > 0, 0 < top_p <= 1, top_k >= 0, candidates >= 1; got "
                             f"{temperature}, {top_p}, {top_k}, {candidates}")
        self.temperature, self.top_p, self.top_k, self.candidates = temperature, top_p, top_k, candidates

    def __call__(self, input_ids, scores):
        import torch

        scores = scores.float() / self.temperature  # (B, V)
        k = min(self.top_k or self.candidates, scores.shape[-1])
        vals, idx = scores.topk(k, dim=-1)  # (B, k), descending
        # probabilities in the full distribution, or, with top_k, in the top-k one (transformers' top-p after top-k)
        norm = vals.logsumexp(-1, keepdim=True) if self.top_k else scores.logsumexp(-1, keepdim=True)
        probs = (vals - norm).exp()  # (B, k)
        keep = (probs.cumsum(-1) - probs) < self.top_p  # the mass ranked above each candidate
        keep[:, 0] = True
        noisy = torch.where(keep, vals - torch.empty_like(vals).exponential_().log(), float("-inf"))
        choice = idx.gather(-1, noisy.argmax(-1, keepdim=True))  # (B, 1)
        wide = probs.sum(-1) < self.top_p if not self.top_k else torch.zeros_like(keep[:, 0])
        if wide.any():  # the nucleus extends past the candidates: the whole vocabulary for these rows
            from transformers import TopPLogitsWarper

            rows = scores[wide]
            if self.top_p < 1:
                rows = TopPLogitsWarper(self.top_p)(None, rows)
            choice[wide] = (rows - torch.empty_like(rows).exponential_().log()).argmax(-1, keepdim=True)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(-1, choice, 0.0)


MIN_SHARED_PREFIX = 16  # tokens; below this a batch-1 prefill costs more than it saves


def prefix_cache_batch(model, rows: list[list[int]], pad_id: int, device):
    """A batch whose rows all start with the same P tokens, laid out so that one key/value cache of those P tokens
    serves every row: `prefix + pads + rest` (the pads masked out in the middle, not on the left; positions come
    from the attention mask's cumulative sum, so every real token keeps the position it has unpadded). Returns
    (input_ids (B, T), attention_mask (B, T), generate kwargs with the cache) or None when there is no shared prefix
    worth caching or the model's cache is not a plain attention cache (recurrent and linear-attention layers would
    carry state across the pads)."""
    import torch

    if len(rows) < 2:
        return None
    shortest = min(len(r) for r in rows)
    p = 0
    first = rows[0]
    while p < shortest - 1 and all(r[p] == first[p] for r in rows):  # at least one token per row stays uncached
        p += 1
    if p < MIN_SHARED_PREFIX:
        return None
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([first[:p]], device=device), use_cache=True)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    layers = getattr(cache, "layers", None)
    if cache is None or not layers or any(type(l).__name__ != "DynamicLayer" for l in layers):
        return None
    cache.batch_repeat_interleave(len(rows))  # (1, H, P, D) -> (B, H, P, D) per layer
    width = max(len(r) for r in rows)
    ids = [first[:p] + [pad_id] * (width - len(r)) + r[p:] for r in rows]
    mask = [[1] * p + [0] * (width - len(r)) + [1] * (len(r) - p) for r in rows]
    return torch.tensor(ids), torch.tensor(mask), {_generate_cache_kwarg(): cache}


def _generate_cache_kwarg() -> str:
    """transformers 5.x takes `cache=` (`past_key_values=` deprecated), 4.x only `past_key_values=`."""
    from transformers.generation import utils

    return "cache" if "cache" in getattr(utils, "ALL_CACHE_NAMES", ()) else "past_key_values"


