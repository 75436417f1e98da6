"""The decode loop (`Engine`): batching by length, the shared prefix prefilled once, finished rows compacted out,
and sdpa attention while decoding."""

from __future__ import annotations

import contextlib
import inspect
from typing import Sequence

from conversations.config import ConfigError
from conversations.memory import release_memory
from generator.engine.cache import _growing_layer_class, cache_keyword, new_cache
from generator.engine.resume import cached_lengths, row_caches, stacked_cache
from generator.engine.sampler import NucleusSampler
from generator.engine.settings import Completion, SamplingSettings, stop_token_ids

MIN_SHARED_PREFIX = 16  # tokens; below this a batch-1 prefill of the prefix costs more than it saves
# tokens per prefill forward: SmolLM2's prefill ran ~4,200 tokens/s up to ~4k tokens a forward on 2 CPU cores and
# 3,100 at 15k (activations that no longer fit the caches), so a large batch is prefilled in row chunks of this size
PREFILL_CHUNK_TOKENS = 4096


class Engine:
    """Batched sampling from a causal LM (see the module docstring). `precision`: the process precision
    (`conversations.precision.resolve_precision`); fp32 weights then run under its autocast, bf16 ones as they are."""

    def __init__(self, model, tokenizer, *, batch_size: int = 64, precision: str | None = None,
                 stop_ids: Sequence[int] | None = None, share_prefix: bool = True, compact: bool = True,
                 growing_cache: bool = True, prefill_tokens: int = PREFILL_CHUNK_TOKENS):
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        self.model, self.tokenizer = model, tokenizer
        self.batch_size = batch_size
        self.precision = precision
        self.stops = sorted(set(stop_ids if stop_ids is not None else stop_token_ids(tokenizer, model)))
        self.share_prefix, self.compact, self.growing_cache = share_prefix, compact, growing_cache
        self.prefill_tokens = prefill_tokens  # tokens per prefill forward (row chunks of a larger batch)
        self._max_new = 64
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stops[0]
        params = inspect.signature(model.forward).parameters
        self._cache_kw = cache_keyword(model)
        self._keep_kw = "logits_to_keep" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())

    # ---------------------------------------------------------------------------------------------------- public
    def complete_texts(self, prompts: Sequence[str], settings: SamplingSettings, seed: int = 0,
                       n: int = 1) -> list[Completion]:
        """`n` completions per rendered prompt, prompt-major (tokenized without adding special tokens: the template
        holds them)."""
        ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        return self.complete(ids, settings, seed, n=n)

    def complete(self, prompts: Sequence[Sequence[int]], settings: SamplingSettings, seed: int = 0,
                 cancelled: Sequence | None = None, n: int = 1, states: list | None = None) -> list[Completion]:
        """`n` completions per prompt (token ids), prompt-major: [p0 s0, p0 s1, ..., p1 s0, ...]. Prompts are batched
        by length (less padding); the same seed, prompts, batch size and n give the same completions; the caller's
        torch RNG is left as it was. With n > 1 each prompt is prefilled once and its cache repeated n times (a batch
        holds about batch_size // n prompts). `cancelled[i]()` returning True stops prompt i at the next token (what
        it has so far is returned): a server drops the requests whose clients have gone.

        `states` (n = 1 only; `generator.engine.resume`): one entry per prompt, None or the `PromptCache` of an
        earlier prompt that this one extends, whose tokens are then not prefilled again; each entry is replaced by
        the cache of its prompt (None where the model keeps its own kind of cache)."""
        import torch

        if not prompts:
            return []
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if states is not None and (n != 1 or len(states) != len(prompts)):
            raise ValueError(f"states needs n = 1 and one entry per prompt, got n={n}, {len(states)} for {len(prompts)}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        model = self.model
        device = next(model.parameters()).device
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: list[list[Completion] | None] = [None] * len(prompts)
        per_batch = max(1, self.batch_size // n)
        sampler = NucleusSampler.from_settings(settings)
        was_training = model.training
        model.eval()
        devices = [device.index or 0] if device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), torch.inference_mode(), self._autocast(device), \
                    decoding_attention(model):
                torch.manual_seed(seed)
                for start in range(0, len(order), per_batch):
                    if start:
                        release_memory()  # the last batch's cache back to the system before the next one's lands
                    idx = order[start : start + per_batch]
                    gone = [cancelled[i] for i in idx] if cancelled is not None else None
                    held = None if states is None else [states[i] for i in idx]
                    done = self._batch([list(prompts[i]) for i in idx], settings, sampler, device, gone, n=n,
                                       states=held)
                    for j, i in enumerate(idx):
                        results[i] = done[j * n : (j + 1) * n]
                        if states is not None:
                            states[i] = held[j]
        finally:
            model.train(was_training)
        return [c for cs in results for c in cs]  # type: ignore[union-attr]

    # ---------------------------------------------------------------------------------------------------- inside
    def _autocast(self, device):
        import contextlib

        import torch

        from conversations.precision import autocast

        weights = next(self.model.parameters()).dtype
        if self.precision in (None, "fp32") or weights != torch.float32:
            return contextlib.nullcontext()
        return autocast(self.precision, device)

    def _forward(self, ids, mask, pos, cache):
        import torch

        kw = {self._cache_kw: cache, "use_cache": True}
        if self._keep_kw:
            # the last position only: never a (B, T, vocab) tensor over the prompt. As an index tensor, not the int 1:
            # the int slices a non-contiguous (B, 1, H) view, and torch 2.13's CPU linear on such an input with a
            # frozen (requires_grad=False) weight took 6.7 s instead of 16 ms for SmolLM2's output layer at 64 rows
            T = ids.shape[1]
            kw["logits_to_keep"] = 1 if T == 1 else torch.tensor([T - 1], device=ids.device)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, **kw)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        return out.logits[:, -1, :], cache  # (B, V)

    def _grows(self) -> bool:
        """True when the engine uses its growing cache: asked for, and every layer of the model full attention."""
        cfg = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else self.model.config
        return self.growing_cache and set(getattr(cfg, "layer_types", None) or ["full_attention"]) == {"full_attention"}

    def _new_cache(self, rows, first: int | None = None):
        """Our growing cache for plain attention models (Llama-like: every layer full attention), else None (the
        model builds its own: sliding windows, recurrent state). Sized for the longest row and the token budget:
        `first` is how many tokens the first forward writes (the shared prefix; default the longest row)."""
        if not self._grows():
            return None
        longest = max(len(r) for r in rows)
        # the first write allocates `first + reserve` slots: exactly the longest row and its token budget
        return new_cache(reserve=max(1, longest + self._max_new - (longest if first is None else first)))

    def _prefix(self, rows: list[list[int]], device):
        """(P, cache of the first P tokens, batch 1) when every row starts with the same P >= 16 tokens and the
        cache is a plain attention cache, else (0, None)."""
        import torch

        if not self.share_prefix or len(rows) < 2:
            return 0, None
        shortest = min(len(r) for r in rows)
        first, p = rows[0], 0
        while p < shortest - 1 and all(r[p] == first[p] for r in rows):  # at least one token per row stays uncached
            p += 1
        if p < MIN_SHARED_PREFIX:
            return 0, None
        _, cache = self._forward(torch.tensor([first[:p]], device=device), torch.ones(1, p, dtype=torch.long, device=device),
                                 torch.arange(p, device=device)[None], self._new_cache(rows, first=p))
        layers = getattr(cache, "layers", None)
        if cache is None or not layers or any(not isinstance(l, self._layer_types) for l in layers):
            return 0, None  # recurrent or sliding-window layers would carry state across the pads
        return p, cache

    def _prefill(self, ids, mask, pos, prefix, rows: list[list[int]], resumed=None):
        """(logits (B, V), cache) of the prompts' first forward: the prefix cache (batch 1) repeated over the rows, or
        the rows' own cached parts (`resumed`: states and cached lengths), in row chunks of about
        PREFILL_CHUNK_TOKENS tokens whose caches are then joined (our growing cache only; any other cache is
        prefilled in one forward)."""
        import copy

        import torch

        B, W = ids.shape
        chunk = max(1, self.prefill_tokens // max(1, W))

        def start(part: slice):  # the cache a chunk's forward writes into
            if resumed is not None:
                states, held = resumed
                like = next(st for st, c in zip(states, held) if c)
                return stacked_cache(states[part], held[part], max(held), like, reserve=W + self._max_new)
            if prefix is None:
                return self._new_cache(rows)  # ours (growing) or None (the model's own)
            cache = copy.deepcopy(prefix) if B > chunk else prefix
            cache.batch_repeat_interleave(ids[part].shape[0])  # (1, H, P, D) -> (b, H, P, D) per layer
            return cache

        growing = resumed is not None or (prefix is None and self._grows()) or (
            prefix is not None and all(isinstance(layer, _growing_layer_class()) for layer in prefix.layers))
        if B <= chunk or not growing:
            return self._forward(ids, mask, pos, start(slice(0, B)))
        logits, caches = [], []
        for s in range(0, B, chunk):
            part = slice(s, s + chunk)
            lg, cache = self._forward(ids[part], mask[part], pos[part], start(part))
            logits.append(lg)
            caches.append(cache)
        joined = caches[0]
        for i, layer in enumerate(joined.layers):  # every chunk's buffer has the same length: same prompts' width
            layer._k = torch.cat([c.layers[i]._k for c in caches])
            layer._v = torch.cat([c.layers[i]._v for c in caches])
            layer._view()
            for c in caches[1:]:  # freed layer by layer: the join never holds two copies of the whole cache
                c.layers[i]._k = c.layers[i]._v = c.layers[i].keys = c.layers[i].values = None
        return torch.cat(logits), joined

    def _batch(self, rows: list[list[int]], s: SamplingSettings, sampler, device, gone=None,
               n: int = 1, states: list | None = None) -> list[Completion]:
        """One batch; `states` (n = 1): each row's `PromptCache` or None, replaced by the row's prompt's cache."""
        import torch

        from transformers.cache_utils import DynamicLayer

        self._layer_types = (DynamicLayer,)
        self._max_new = s.max_new_tokens
        B = len(rows)
        held = cached_lengths(rows, states)
        resumed = None
        if any(held) and self._grows():
            p, prefix, resumed = max(held), None, (states, held)  # each row's own cached part, left-padded to p
            rest = [r[c:] for r, c in zip(rows, held)]
            cached_mask = [[0] * (p - c) + [1] * c for c in held]
        else:
            p, prefix = self._prefix(rows, device)
            rest = [r[p:] for r in rows]
            cached_mask = [[1] * p] * B
        width = max(len(r) for r in rest)
        ids = torch.tensor([[self.pad_id] * (width - len(r)) + r for r in rest], device=device)  # (B, W)
        mask = torch.tensor([m + [0] * (width - len(r)) + [1] * len(r) for m, r in zip(cached_mask, rest)],
                            device=device)  # (B, P+W)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, p:]  # (B, W): positions as if unpadded
        logits, cache = self._prefill(ids, mask, pos, prefix, rows, resumed)
        if states is not None:  # the prompts' caches, before decoding writes into them
            growing = cache is not None and all(isinstance(l, _growing_layer_class()) for l in cache.layers)
            states[:] = row_caches(cache, mask, rows) if growing else [None] * B
        if n > 1:  # n samples of each prompt from one prefill: every row of the cache repeated n times, in place
            logits, mask, pos = (t.repeat_interleave(n, 0) for t in (logits, mask, pos))
            cache.batch_repeat_interleave(n)
            gone = None if gone is None else [g for g in gone for _ in range(n)]
            B = B * n
        last = pos[:, -1]  # (B,)
        stops = torch.tensor(self.stops, device=device)
        live = torch.arange(B, device=device)  # which rows of `rows` the batch still holds
        out: list[list[int]] = [[] for _ in range(B)]
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        for step in range(s.max_new_tokens):
            if step < s.min_new_tokens:
                logits[:, stops] = float("-inf")
            tok = logits.argmax(-1) if sampler is None else sampler(logits)  # (b,)
            for r, t, f in zip(live.tolist(), tok.tolist(), finished[live].tolist()):
                if not f:
                    out[r].append(t)
            finished[live] |= torch.isin(tok, stops)
            if gone is not None:
                for r in live.tolist():
                    if not finished[r] and gone[r] is not None and gone[r]():
                        finished[r] = True
            if step + 1 == s.max_new_tokens or bool(finished.all()):
                break
            done = finished[live]  # (b,)
            # compaction copies the whole cache: worth it once a quarter of the rows are done, not for every one
            if self.compact and int(done.sum()) >= max(1, len(live) // 4):
                keep = (~done).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                live, mask, last, tok = live[keep], mask[keep], last[keep], tok[keep]
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
            last = last + 1
            logits, cache = self._forward(tok[:, None], mask, last[:, None], cache)
        return [self._completion(o) for o in out]

    def _completion(self, ids: list[int]) -> Completion:
        stop_set = set(self.stops)
        cut = next((k for k, t in enumerate(ids) if t in stop_set), None)
        stopped = cut is not None
        if stopped:
            ids = ids[: cut + 1]
        body = ids[:-1] if stopped else ids
        text = self.tokenizer.decode(body, skip_special_tokens=True)
        return Completion(ids=ids, text=text, stopped=stopped, stop_id=ids[-1] if stopped else None)


@contextlib.contextmanager
def decoding_attention(model):
    """sdpa while the engine decodes a model that trains with eager attention (`generator.model.prepare_training` on
    a CPU): a decoding step of 64 rows took 96 ms with eager against 61 ms with sdpa here. Restored on exit."""
    from generator.model import set_attention

    if getattr(getattr(model, "config", None), "_attn_implementation", None) != "eager" or not set_attention(model, "sdpa"):
        yield
        return
    try:
        yield
    finally:
        set_attention(model, "eager")
