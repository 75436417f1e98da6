"""The engine's key/value cache: layers that grow into room reserved ahead instead of concatenating."""

from __future__ import annotations

import functools
import inspect


def cache_keyword(model) -> str:
    """The forward's name for the key/value cache: transformers 5 calls it `cache`, 4.x `past_key_values`; a PEFT
    wrapper passes either through."""
    params = inspect.signature(model.forward).parameters
    return "past_key_values" if "past_key_values" in params and "cache" not in params else "cache"


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
