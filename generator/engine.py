"""The one generation engine: every caller that samples text from a causal LM here goes through `Engine` (held-out
simulation, the discriminator's simulated turns, whole conversations, the local assistant, agent turns and the
simulator server, and GRPO's rollouts through TRL's `rollout_func`, `EngineRollout`).

What it does that `model.generate` does not, each measured on 2 CPU cores (docs/benchmarks.md):
- **a shared prefix is run once**: the tokens every prompt of a batch starts with (the simulator's system prompt) get
  one key/value cache, repeated over the batch; each row is laid out `prefix + pads + rest` with the pads masked and
  positions counted as if unpadded, so every real token sees what it would see unpadded;
- **finished rows leave the batch**: a row that sampled a stop token (or its budget) is dropped from the cache and the
  mask at once, so a batch costs the sum of its turns' lengths, not rows x the longest turn;
- **sampling without a full sort**: `NucleusSampler` draws from exactly transformers' temperature/top-k/top-p
  distribution, finding the nucleus among the tokens above a probability floor and sorting only those (the whole
  vocabulary only for rows whose nucleus reaches below every floor);
- **the precision the process runs in**: frozen bf16 weights run as they are; fp32 weights run under bf16 autocast
  when the process precision is bf16 (see `conversations.precision`).

Sampling settings are one object, `SamplingSettings`, shared by every caller and recorded in the export.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import asdict, dataclass
from typing import Sequence

from conversations.config import ConfigError
from conversations.memory import release_memory

MIN_SHARED_PREFIX = 16  # tokens; below this a batch-1 prefill of the prefix costs more than it saves
# tokens per prefill forward: SmolLM2's prefill ran ~4,200 tokens/s up to ~4k tokens a forward on 2 CPU cores and
# 3,100 at 15k (activations that no longer fit the caches), so a large batch is prefilled in row chunks of this size
PREFILL_CHUNK_TOKENS = 4096


@dataclass(frozen=True)
class SamplingSettings:
    """How a turn is sampled. The simulator's export records the settings it was trained and measured with, and
    `agent_rl.users.load_simulator` / `agent_rl.serve` default to them."""

    max_new_tokens: int = 64  # token budget of one turn
    temperature: float = 1.0  # 0: greedy
    top_p: float = 0.95  # nucleus mass (1: off)
    top_k: int = 0  # 0: off
    min_new_tokens: int = 1  # stop tokens are masked before this many tokens
    max_prompt_tokens: int | None = None  # prompt budget, older messages dropped from the left (None: no limit)

    def __post_init__(self):
        checks = [
            (self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0 (0 is greedy), got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 is off), got {self.top_k}"),
            (self.min_new_tokens >= 0, f"min_new_tokens must be >= 0, got {self.min_new_tokens}"),
            (self.max_prompt_tokens is None or self.max_prompt_tokens >= 16,
             f"max_prompt_tokens must be >= 16 (or null), got {self.max_prompt_tokens}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)

    def replace(self, **changes) -> "SamplingSettings":
        return SamplingSettings(**{**asdict(self), **{k: v for k, v in changes.items() if v is not None}})

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "SamplingSettings":
        known = {k: v for k, v in (d or {}).items() if k in cls.__dataclass_fields__}
        return cls(**known)


@dataclass
class Completion:
    ids: list[int]  # the sampled tokens, the stop token included when one was sampled
    text: str  # decoded, special tokens and the stop token left out
    stopped: bool  # True: a stop token ended it; False: it ran out of `max_new_tokens`
    stop_id: int | None = None  # the stop token sampled, if any


def stop_token_ids(tokenizer, model=None) -> list[int]:
    """Token ids that end a turn: the tokenizer's and the model's eos, and every other special token (`<|im_start|>`
    opening a new turn, `<|endoftext|>`): none belongs inside a turn."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if model is not None:
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else list(eos or []))
    ids.update(int(i) for i in tokenizer.all_special_ids)
    return sorted(ids)


class NucleusSampler:
    """Draws one token per row from exactly the distribution of transformers' sampling (`TemperatureLogitsWarper`,
    `TopKLogitsWarper`, `TopPLogitsWarper`, then multinomial) without sorting the vocabulary. The nucleus (the tokens
    whose higher-ranked tokens hold less than `top_p` of the probability) is looked for among the tokens of
    probability >= `floors[0]`: when those hold >= `top_p`, every nucleus token is among them, and only they are
    sorted. Rows whose candidates hold less try `floors[1]`, and so on; only the rows still short get a full sort. The
    draw is the inverse of the nucleus' cumulative distribution at one uniform number per row.

    Why: on SmolLM2's 49k-token vocabulary at top_p 0.95 the nucleus held 1-6,910 tokens (median 89; 35% of row-steps
    over 256), so `topk` over candidate counts that cover it (256, then 4,096) took 25 ms a call (median, 95-128 rows)
    on 2 CPU cores, a full sort ~1 ms a row; these floors take 12 ms on the same logits (`bench/bench_sampler.py`,
    docs/benchmarks.md). Draws use the global torch RNG (seeded by the caller)."""

    BLOCK = 64  # vocabulary entries a block: candidates are looked for in the blocks whose maximum clears the floor

    def __init__(self, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 floors: tuple[float, ...] = (3e-5, 1e-5, 1e-6)):
        if temperature <= 0 or not 0 < top_p <= 1 or top_k < 0 or any(not 0 < f < 1 for f in floors):
            raise ValueError(f"need temperature > 0, 0 < top_p <= 1, top_k >= 0, 0 < floors < 1; got "
                             f"{temperature}, {top_p}, {top_k}, {floors}")
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.floors = tuple(sorted(floors, reverse=True))

    @classmethod
    def from_settings(cls, s: SamplingSettings) -> "NucleusSampler | None":
        return None if s.temperature == 0 else cls(s.temperature, s.top_p, s.top_k)

    def __call__(self, scores):
        """scores (B, V) -> sampled token ids (B,)."""
        import torch

        x = scores.float()  # (B, V)
        if self.temperature != 1:
            x = x / self.temperature
        B, V = x.shape
        if self.top_p >= 1 and not self.top_k:  # the whole vocabulary: Gumbel-max, no nucleus to find
            return (x - torch.empty_like(x).exponential_().log()).argmax(-1)
        if self.top_k:  # top-p within the top-k distribution (transformers' order of warpers)
            vals, idx = x.topk(min(self.top_k, V), dim=-1)  # (B, k), descending
            return idx.gather(-1, self._draw_sorted(vals - vals.logsumexp(-1, keepdim=True))).squeeze(-1)
        norm = x.logsumexp(-1)  # (B,)
        out = torch.empty(B, dtype=torch.long, device=x.device)
        rows = torch.arange(B, device=x.device)
        for floor in self.floors:
            sub = x if len(rows) == B else x[rows]  # no (B, V) copy on the first pass
            fits, tok = self._draw_among_candidates(sub, norm[rows], floor)
            out[rows[fits]] = tok[fits]
            rows = rows[~fits]
            if not len(rows):
                return out
        vals, idx = x[rows].sort(dim=-1, descending=True)  # the rows whose nucleus is wider than every floor
        out[rows] = idx.gather(-1, self._draw_sorted(vals - norm[rows, None])).squeeze(-1)
        return out

    def _draw_sorted(self, logp):
        """logp (b, k) of tokens sorted by descending probability -> (b, 1) positions drawn from its nucleus."""
        import torch

        p = logp.double().exp()  # (b, k)
        cum = p.cumsum(-1)
        n = ((cum - p) < self.top_p).sum(-1, keepdim=True).clamp(min=1) if self.top_p < 1 else \
            torch.full_like(cum[:, :1], p.shape[-1], dtype=torch.long)  # (b, 1) nucleus size
        u = torch.rand_like(cum[:, :1]) * cum.gather(-1, n - 1)  # (b, 1), uniform over the nucleus mass
        return torch.searchsorted(cum, u).clamp(max=n - 1)

    def _candidates(self, x, lo):
        """(rows, columns) of the entries of x (b, V) >= lo (b,), row-major: a compare over the block maxima first,
        then over the blocks that clear it (a third of SmolLM2's at the first floor), not over every entry."""
        b, V = x.shape
        if V % self.BLOCK:
            return (x >= lo[:, None]).nonzero(as_tuple=True)
        blocks = x.view(b, V // self.BLOCK, self.BLOCK)
        rb, cb = (blocks.amax(-1) >= lo[:, None]).nonzero(as_tuple=True)  # (m,) blocks that hold a candidate
        i, j = (blocks[rb, cb] >= lo[rb, None]).nonzero(as_tuple=True)  # (n,) candidates in those blocks
        return rb[i], cb[i] * self.BLOCK + j

    def _draw_among_candidates(self, x, norm, floor: float):
        """x (b, V) scores, norm (b,) their logsumexp -> (fits (b,), tokens (b,)): a row fits when its tokens of
        probability >= floor hold >= top_p (then its token is drawn from the nucleus among them); others' tokens
        are meaningless."""
        import math

        import torch

        b = x.shape[0]
        r, c = self._candidates(x, norm + math.log(floor))  # (n,) each
        lp = x[r, c] - norm[r]  # (n,) log-probabilities, <= 0
        # candidates ordered by row, then by descending probability, in one sort: the row in the high 32 bits, the
        # bits of -logp (a non-negative float32's bits order as its value) in the low ones
        key = (r << 32) | (-lp).abs().view(torch.int32).long()
        order = key.argsort()
        r, c, p = r[order], c[order], lp[order].double().exp()
        cum = p.cumsum(0)  # (n,) over every row's candidates in turn
        count = torch.bincount(r, minlength=b)  # (b,)
        start = (count.cumsum(0) - count).clamp(max=max(len(p) - 1, 0))
        before = torch.where(count > 0, cum[start] - p[start], 0) if len(p) else torch.zeros(b, dtype=p.dtype)
        keep = (cum - p - before[r]) < self.top_p  # the mass ranked above each candidate, in its row
        mass = torch.zeros(b, dtype=p.dtype, device=x.device).index_add_(0, r, p)
        fits = (count > 0) & (mass >= self.top_p)
        n = torch.zeros(b, dtype=torch.long, device=x.device).index_add_(0, r, keep.long()).clamp(min=1)
        kept = torch.zeros_like(mass).index_add_(0, r, p * keep)
        u = torch.rand_like(mass) * kept  # (b,), uniform over each row's nucleus mass
        at = torch.searchsorted(cum, before + u)
        at = torch.minimum(torch.maximum(at, start), start + n - 1).clamp(max=max(len(c) - 1, 0))
        return fits, (c[at] if len(c) else torch.zeros(b, dtype=torch.long, device=x.device))


@functools.lru_cache(maxsize=None)
def _growing_layer_class():
    """A transformers `DynamicLayer` that writes new keys and values into room reserved ahead instead of
    concatenating: `torch.cat` copies the whole cache at every decoding step (a quarter of a step of SmolLM2 at 64
    rows on 2 CPU cores). `reserve` tokens of room are added whenever the buffer is full."""
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        def __init__(self, reserve: int = 64, **kwargs):
            super().__init__(**kwargs)
            self.reserve, self.n, self._k, self._v = max(1, reserve), 0, None, None

        def _view(self):
            self.keys, self.values = self._k[:, :, : self.n], self._v[:, :, : self.n]  # (B, H, n, D)

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            new = key_states.shape[-2]
            if self._k is None or self.n + new > self._k.shape[-2] or self._k.shape[0] != key_states.shape[0]:
                B, H, _, D = key_states.shape
                k = key_states.new_empty(B, H, self.n + new + self.reserve, D)
                v = value_states.new_empty(B, H, self.n + new + self.reserve, value_states.shape[-1])
                if self.n:
                    k[:, :, : self.n], v[:, :, : self.n] = self.keys, self.values
                self._k, self._v = k, v
            self._k[:, :, self.n : self.n + new] = key_states
            self._v[:, :, self.n : self.n + new] = value_states
            self.n += new
            self._view()
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.n

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.n:
                self._k = self._k.repeat_interleave(repeats, dim=0)
                self._v = self._v.repeat_interleave(repeats, dim=0)
                self._view()

        def batch_select_indices(self, indices) -> None:
            if self.n:
                self._k, self._v = self._k[indices], self._v[indices]
                self._view()

        def crop(self, tokens_to_remove: int) -> None:
            raise NotImplementedError("the engine never crops its cache")

    return GrowingLayer


def new_cache(reserve: int):
    """An empty key/value cache of `GrowingLayer`s (one per attention layer, made as the model first writes it)."""
    from transformers.cache_utils import Cache

    return Cache(layer_class_to_replicate=functools.partial(_growing_layer_class(), reserve=reserve))


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
        # transformers 5 names the cache `cache`, 4.x `past_key_values`; a PEFT wrapper passes either through
        self._cache_kw = "past_key_values" if "past_key_values" in params and "cache" not in params else "cache"
        self._keep_kw = "logits_to_keep" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())

    # ---------------------------------------------------------------------------------------------------- public
    def complete_texts(self, prompts: Sequence[str], settings: SamplingSettings, seed: int = 0,
                       n: int = 1) -> list[Completion]:
        """`n` completions per rendered prompt, prompt-major (tokenized without adding special tokens: the template
        holds them)."""
        ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        return self.complete(ids, settings, seed, n=n)

    def complete(self, prompts: Sequence[Sequence[int]], settings: SamplingSettings, seed: int = 0,
                 cancelled: Sequence | None = None, n: int = 1) -> list[Completion]:
        """`n` completions per prompt (token ids), prompt-major: [p0 s0, p0 s1, ..., p1 s0, ...]. Prompts are batched
        by length (less padding); the same seed, prompts, batch size and n give the same completions; the caller's
        torch RNG is left as it was. With n > 1 each prompt is prefilled once and its cache repeated n times (a batch
        holds about batch_size // n prompts). `cancelled[i]()` returning True stops prompt i at the next token (what
        it has so far is returned): a server drops the requests whose clients have gone."""
        import torch

        if not prompts:
            return []
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
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
                    done = self._batch([list(prompts[i]) for i in idx], settings, sampler, device, gone, n=n)
                    for j, i in enumerate(idx):
                        results[i] = done[j * n : (j + 1) * n]
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

    def _new_cache(self, rows, first: int | None = None):
        """Our growing cache for plain attention models (Llama-like: every layer full attention), else None (the
        model builds its own: sliding windows, recurrent state). Sized for the longest row and the token budget:
        `first` is how many tokens the first forward writes (the shared prefix; default the longest row)."""
        cfg = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else self.model.config
        types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
        if not self.growing_cache or types != {"full_attention"}:
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

    def _prefill(self, ids, mask, pos, prefix, rows: list[list[int]]):
        """(logits (B, V), cache) of the prompts' first forward: the prefix cache (batch 1) repeated over the rows,
        in row chunks of about PREFILL_CHUNK_TOKENS tokens whose caches are then joined (our growing cache only; any
        other cache is prefilled in one forward)."""
        import copy

        import torch

        B, W = ids.shape
        chunk = max(1, self.prefill_tokens // max(1, W))
        if prefix is None:
            cache = self._new_cache(rows)  # ours (growing) or None (the model's own)
            growing = cache is not None
        else:
            cache = prefix
            growing = all(isinstance(layer, _growing_layer_class()) for layer in prefix.layers)
        if B <= chunk or not growing:
            if prefix is not None:
                cache.batch_repeat_interleave(B)  # (1, H, P, D) -> (B, H, P, D) per layer
            return self._forward(ids, mask, pos, cache)
        logits, caches = [], []
        for s in range(0, B, chunk):
            part = slice(s, s + chunk)
            cache = copy.deepcopy(prefix) if prefix is not None else self._new_cache(rows)
            if prefix is not None:
                cache.batch_repeat_interleave(ids[part].shape[0])
            lg, cache = self._forward(ids[part], mask[part], pos[part], cache)
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
               n: int = 1) -> list[Completion]:
        import torch

        from transformers.cache_utils import DynamicLayer

        self._layer_types = (DynamicLayer,)
        self._max_new = s.max_new_tokens
        B = len(rows)
        p, prefix = self._prefix(rows, device)
        rest = [r[p:] for r in rows]
        width = max(len(r) for r in rest)
        ids = torch.tensor([[self.pad_id] * (width - len(r)) + r for r in rest], device=device)  # (B, W)
        mask = torch.tensor([[1] * p + [0] * (width - len(r)) + [1] * len(r) for r in rest], device=device)  # (B, P+W)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, p:]  # (B, W): positions as if unpadded
        logits, cache = self._prefill(ids, mask, pos, prefix, rows)
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


def _copied_weights(model, dtype) -> tuple[dict, bool]:
    """A `copy.deepcopy` memo that makes the copy's parameters in `dtype` as they are copied, each LoRA layer's base
    weight already merged with its active adapters (`base + delta` in the weights' own precision, then cast: what
    peft's merge followed by a cast gives): a deepcopy in fp32 first would cost the model's size again (a 1.0 GB
    transient for SmolLM2 + LoRA, 0.3 GB this way), and the hole it leaves is where the next stage's peak lands.
    Returns (memo, merged). merged is False for a model without adapters (the memo only casts); the memo is empty (a
    plain deepcopy, peft merges after it, the cast comes last: as before) for any other adapter than plain LoRA on a
    peft model (DoRA, a LoRA bias, a merged or disabled adapter, another tuner) or a weight that is not a plain
    floating-point tensor (quantized)."""
    import torch

    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        LoraLayer = ()
    memo: dict = {}
    if any(type(p) is not torch.nn.Parameter or not p.dtype.is_floating_point for p in model.parameters()):
        return memo, False
    lora = [m for m in model.modules() if LoraLayer and isinstance(m, LoraLayer)]
    adapted = bool(lora) or hasattr(model, "merge_and_unload")
    plain = adapted and bool(lora) and hasattr(model, "unload") and not getattr(model, "_disabled_adapter", False) \
        and all(not m.merged and not m.disable_adapters and not any(m.use_dora.get(a) for a in m.active_adapters)
                and not any(getattr(m, "lora_bias", {}).get(a) for a in m.active_adapters)
                and hasattr(m.get_base_layer(), "weight") for m in lora)
    if adapted and not plain:
        return memo, False
    with torch.no_grad():
        if plain:
            for m in lora:
                w = m.get_base_layer().weight
                merged = w.detach()
                for a in m.active_adapters:
                    if a in m.lora_A:
                        merged = merged + m.get_delta_weight(a).to(w.dtype)
                memo[id(w)] = torch.nn.Parameter(merged.to(dtype, copy=True), requires_grad=False)
        for p in model.parameters():
            if id(p) not in memo:
                memo[id(p)] = torch.nn.Parameter(p.detach().to(dtype, copy=True), requires_grad=False)
    return memo, plain


def inference_copy(model, precision: str = "fp32"):
    """A frozen copy of `model` for the engine: any LoRA adapter merged, weights in the precision's dtype (a bf16 copy
    decodes faster than autocast over fp32 weights, which re-casts every weight at every step), eval mode. The
    original is not touched."""
    import copy

    from conversations.precision import inference_dtype

    memo, merged = _copied_weights(model, inference_dtype(precision))
    frozen = copy.deepcopy(model, memo)
    if merged:
        frozen = frozen.unload()  # the LoRA layers dropped; their base weights are the merged ones
    elif hasattr(frozen, "merge_and_unload"):
        frozen = frozen.merge_and_unload()
    for module in frozen.modules():
        # a forward patched onto the instance (TRL's fused LM head, accelerate's autocast wrapper) is a closure over
        # the *original* model: the copy would run the training weights. The copy runs its class's own forward
        module.__dict__.pop("forward", None)
    if getattr(frozen.config, "_attn_implementation", None) == "eager":
        from generator.model import set_attention

        set_attention(frozen, "sdpa")  # trained with eager on a CPU; sdpa decodes faster
    return frozen.to(inference_dtype(precision)).eval().requires_grad_(False)


def inference_model(model_wrapped, accelerator, *, precision: str = "fp32", merge_lora: bool = True,
                    gather_zero3: bool = True):
    """The trainer's model, ready for the engine outside TRL: unwrapped, gradient checkpointing off (TRL's
    `unwrap_model_for_generation`, which under ZeRO-3 also gathers the partitioned weights so that every rank runs
    whole layers) and, with `merge_lora` on an unsharded model, a frozen copy with any LoRA adapter merged (plain
    linear layers: LoRA's extra matmuls cost ~20% of a decoding step on a CPU) in the precision's dtype (a bf16 copy
    decodes faster than autocast over fp32 weights, which re-casts every weight at every step). The copy is dropped on
    exit; the training weights are never touched. A context manager."""
    import contextlib

    from accelerate.utils import DistributedType
    from trl.models import unwrap_model_for_generation

    @contextlib.contextmanager
    def ctx():
        sharded = accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP)
        with unwrap_model_for_generation(model_wrapped, accelerator, gather_deepspeed3_params=gather_zero3) as model:
            if merge_lora and not sharded:
                yield inference_copy(model, precision)  # + one copy of the weights while it is in use
            else:
                yield model

    return ctx()


class EngineRollout:
    """TRL `rollout_func` for `GRPOTrainer` on plain-text prompts: the group's completions are sampled by this engine
    from a merged inference copy of the policy (`inference_model`) instead of `model.generate` over the LoRA-wrapped
    training weights. The same distribution (temperature, top-p, top-k as TRL's `GRPOConfig` says), stopping at the
    engine's stop tokens (the trainer's `eos_token_ids` are widened to them, so `mask_truncated_completions` reads a
    turn that ended on `<|im_start|>` as ended). Log-probs are left to TRL to recompute (`logprobs: None`).
    Why: on 2 CPU cores a GRPO step's generation took most of the step through `generate` (LoRA's extra matmuls,
    autocast re-casting every weight at every token, no shared prefix); docs/benchmarks.md has the step times."""

    def __init__(self, tokenizer, settings: SamplingSettings, *, precision: str = "fp32", batch_size: int = 64,
                 seed: int = 0, merge_lora: bool = True):
        self.tokenizer, self.settings, self.precision = tokenizer, settings, precision
        self.batch_size, self.seed, self.merge_lora = batch_size, seed, merge_lora

    @staticmethod
    def settings_from(args) -> SamplingSettings:
        """The engine's settings for a TRL `GRPOConfig`; raises ConfigError for what the engine does not sample with
        (min_p, a repetition penalty): keep `grpo_rollout: trl` for those."""
        extra = dict(args.generation_kwargs or {})
        if getattr(args, "min_p", None) or (getattr(args, "repetition_penalty", 1.0) or 1.0) != 1.0:
            raise ConfigError("grpo_rollout: engine samples with temperature, top_p and top_k only; unset min_p and "
                              "repetition_penalty or set grpo_rollout: trl")
        return SamplingSettings(max_new_tokens=args.max_completion_length, temperature=args.temperature,
                                top_p=args.top_p if args.top_p is not None else 1.0, top_k=int(args.top_k or 0),
                                min_new_tokens=int(extra.get("min_new_tokens", 0)))

    def widen_stops(self, trainer) -> None:
        """Make the trainer read every engine stop token as an end of turn."""
        model = trainer.accelerator.unwrap_model(trainer.model)
        trainer.eos_token_ids = sorted(set(trainer.eos_token_ids) | set(stop_token_ids(self.tokenizer, model)))

    def __call__(self, prompts: list, trainer) -> dict:
        # tokenized as TRL tokenizes a plain-text prompt
        prompt_ids = self.tokenizer(text=list(prompts))["input_ids"]
        step, rank = trainer.state.global_step, trainer.accelerator.process_index
        with inference_model(trainer.model_wrapped, trainer.accelerator, precision=self.precision,
                             merge_lora=self.merge_lora, gather_zero3=trainer.args.ds3_gather_for_generation) as model:
            engine = Engine(model, self.tokenizer, batch_size=self.batch_size, precision=self.precision,
                            stop_ids=trainer.eos_token_ids)
            # differs per step and per process: a repeated prompt must not replay the same random stream
            out = engine.complete(prompt_ids, self.settings, seed=self.seed + 1_000_003 * rank + 7_919 * step)
        return {"prompt_ids": prompt_ids, "completion_ids": [c.ids for c in out], "logprobs": None}
