"""Resuming a prompt from the keys and values of an earlier prompt it extends.

An agent's episode is one growing token sequence: at turn k its prompt is turn k-1's prompt, the turn it sampled
and the new observation. Without this, every turn prefilled the whole episode again (16% of an agent GRPO step here,
docs/benchmarks.md). `Engine.complete(states=...)` takes, per prompt, the `PromptCache` of an earlier prompt that is
a prefix of it, prefills only the tokens after it, and hands back each prompt's own `PromptCache` for the next turn.

In a batch, row i's cached part of L_i tokens and its new part of n_i tokens are each left-padded to the batch's
widest (C and W): the mask is `[0]*(C-L_i) + [1]*L_i + [0]*(W-n_i) + [1]*n_i` and positions count only the ones, so
every token sees what it would see unpadded (the same layout as the shared prefix's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# Memory for the caches a caller keeps between turns (an agent's episodes, an LM user's): SmolLM2-135M holds 23 KB a
# token in bf16, so 2 GiB is ~90k tokens, about 130 live episodes of an agent's ~700 tokens; prompts past it are
# prefilled whole. Many live episodes with every cache kept is what pays: 84 at once ran 1.88x faster with their
# caches, 32 at once 1.44x (bench_entrypoints.py --parts rollout, docs/benchmarks.md).
KV_CACHE_MB = 2048


@dataclass
class PromptCache:
    """The keys and values of one prompt's tokens, every layer, no padding; keys with their positions applied."""

    ids: tuple[int, ...]  # the tokens it holds
    keys: list  # per layer (H, n, D)
    values: list  # per layer (H, n, D)

    def covers(self, prompt: Sequence[int]) -> bool:
        """True when it holds a proper prefix of `prompt` (at least one token is left to prefill)."""
        n = len(self.ids)
        return 0 < n < len(prompt) and tuple(prompt[:n]) == self.ids

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def cached_lengths(rows: Sequence[Sequence[int]], states: Sequence[PromptCache | None] | None) -> list[int]:
    """Tokens each row can take from its state (0: none, or a state that is not a prefix of the row)."""
    if states is None:
        return [0] * len(rows)
    return [len(s.ids) if s is not None and s.covers(r) else 0 for r, s in zip(rows, states)]


def stacked_cache(states: Sequence[PromptCache | None], lengths: Sequence[int], width: int, like: PromptCache,
                  reserve: int):
    """Our growing cache holding every row's cached part, left-padded to `width`: (B, H, width, D) per layer, in
    `like`'s shapes and dtype. Rows with length 0 are all padding (their mask hides it)."""
    from generator.engine.cache import new_cache

    cache = new_cache(reserve=reserve)
    for layer in range(len(like.keys)):
        k0, v0 = like.keys[layer], like.values[layer]
        k = k0.new_zeros(len(lengths), k0.shape[0], width, k0.shape[-1])
        v = v0.new_zeros(len(lengths), v0.shape[0], width, v0.shape[-1])
        for i, (s, n) in enumerate(zip(states, lengths)):
            if n:
                k[i, :, width - n :] = s.keys[layer]
                v[i, :, width - n :] = s.values[layer]
        cache.update(k, v, layer)
    return cache


def row_caches(cache, mask, rows: Sequence[Sequence[int]]) -> list[PromptCache]:
    """Each row's `PromptCache` after its prompt's prefill: the cache's columns where the row's mask is 1."""
    out = []
    for i, r in enumerate(rows):
        cols = mask[i].nonzero().squeeze(-1)  # (len(r),)
        if len(cols) != len(r):
            raise RuntimeError(f"row {i}: {len(cols)} unmasked positions for a prompt of {len(r)} tokens")
        keys = [layer.keys[i].index_select(1, cols) for layer in cache.layers]
        values = [layer.values[i].index_select(1, cols) for layer in cache.layers]
        out.append(PromptCache(tuple(r), keys, values))
    return out


class CacheStore:
    """`PromptCache`s kept between calls under a memory budget, by a caller's key (an episode): `take` hands a
    batch's states to `Engine.complete(states=)`, `keep` stores what it handed back while they fit (in batch order;
    the rest are dropped and their prompts prefilled whole next time), `drop` forgets a finished key."""

    def __init__(self, budget_mb: float):
        self.budget = int(budget_mb * 2**20)
        self.held: dict = {}
        self.used = 0  # bytes held
        self.dropped = 0  # caches handed back that did not fit (their prompts were then prefilled whole)
        self.peak_bytes = 0

    def take(self, keys: Sequence) -> list | None:
        """The states for `keys` (None where nothing is held or the key is None), removed from the store; None when
        the budget is 0 (the engine then keeps nothing)."""
        if self.budget <= 0:
            return None
        out = [self.held.pop(k, None) if k is not None else None for k in keys]
        self.used -= sum(s.nbytes for s in out if s is not None)
        return out

    def keep(self, keys: Sequence, states: Sequence[PromptCache | None] | None) -> None:
        for k, s in zip(keys, states or []):
            if k is None or s is None:
                continue
            if self.used + s.nbytes <= self.budget:
                self.held[k] = s
                self.used += s.nbytes
            else:
                self.dropped += 1
        self.peak_bytes = max(self.peak_bytes, self.used)

    def drop(self, key) -> None:
        s = self.held.pop(key, None)
        self.used -= s.nbytes if s is not None else 0

    def __len__(self) -> int:
        return len(self.held)
