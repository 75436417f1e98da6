"""The GRPO loss's micro-batches by length, each cut to its own width.

TRL pads a step's whole generation batch (8 episodes of 300-1,500 tokens here) to its longest episode, shuffles it
and slices it into micro-batches, so the loss's forward and backward run over every micro-batch at the full width.
`by_length` regroups the same episodes longest first, so each micro-batch holds episodes of like length, and cuts
each to the columns it uses: the prompt's left padding and the completion's right padding that no row needs.

The gradient is the same. TRL's token-level losses (dapo, the default, dr_grpo, grpo) sum over tokens and normalise
by counts that do not depend on how the episodes are grouped ("bnpo" normalises per micro-batch, and would change);
the rows' positions shift by the columns cut, and rotary attention depends only on position differences.

`by_prefix` groups them instead so that a micro-batch's episodes share their prompt (GRPO's group: one task played
`num_generations` times; the system prompt and the gym's rules are ~35-60% of an episode's tokens here), and
`shared_prefix_logps` runs that common prefix once: its keys and values, computed with the gradient on, are
broadcast to every row, and each row's remaining tokens run on top. The gradient is the same (every row's loss
reaches the prefix's activations through that one copy); a unit test checks the log-probs and every gradient.
"""

from __future__ import annotations

PROMPT_KEYS = ("prompt_ids", "prompt_mask")  # left-padded, (B, P); every other (B, T, ...) tensor is the completion's


def _merge(chunks: list[dict]) -> dict:
    import torch

    merged = {}
    for key, first in chunks[0].items():
        values = [c[key] for c in chunks]
        if first is None or (isinstance(first, torch.Tensor) and first.ndim == 0):
            merged[key] = first  # shared by every micro-batch, e.g. num_items_in_batch
        elif isinstance(first, torch.Tensor):
            merged[key] = torch.cat(values)
        else:
            merged[key] = [x for v in values for x in v]
    return merged


def _cut(chunk: dict) -> dict:
    """The columns this micro-batch uses: from its first prompt token, to its last completion token."""
    used_prompt = chunk["prompt_mask"].any(0).nonzero()
    start = int(used_prompt[0]) if len(used_prompt) else chunk["prompt_mask"].shape[1]
    used_completion = chunk["completion_mask"].any(0).nonzero()
    width = chunk["completion_mask"].shape[1]
    stop = int(used_completion[-1]) + 1 if len(used_completion) else 0
    out = {}
    for key, value in chunk.items():
        if key in PROMPT_KEYS:
            out[key] = value[:, start:]
        elif getattr(value, "ndim", 0) >= 2 and value.shape[1] == width:
            out[key] = value[:, :stop]
        else:
            out[key] = value
    return out


def _regroup(chunks: list[dict], rank_of) -> list[dict]:
    """The same episodes in as many micro-batches of the same sizes, ordered by `rank_of(merged)(i)` over the merged
    batch's episodes i (ties in their order), each cut to its used columns."""
    import torch
    from trl.trainer.utils import split_tensor_dict

    if not chunks:
        return chunks
    merged = _merge(chunks)
    rank = rank_of(merged)
    order = torch.tensor(sorted(range(len(merged["prompt_ids"])), key=lambda i: (rank(i), i)))
    ordered = {key: value[order] if isinstance(value, torch.Tensor) and value.ndim > 0
               else [value[int(i)] for i in order] if isinstance(value, list) else value
               for key, value in merged.items()}
    return [_cut(part) for part in split_tensor_dict(ordered, len(chunks))]


def _lengths(merged: dict) -> list[int]:
    return (merged["prompt_mask"].sum(1) + merged["completion_mask"].sum(1)).tolist()  # (B,)


def by_length(chunks: list[dict]) -> list[dict]:
    """The same episodes in as many micro-batches of the same sizes, longest first, each cut to its used columns."""
    def key(merged):
        lengths = _lengths(merged)
        return lambda i: -lengths[i]

    return _regroup(chunks, key)


def padded_tokens(chunks: list[dict]) -> tuple[int, int]:
    """(tokens the loss runs over, tokens that are real) for these micro-batches: the padding's share is 1 - b / a."""
    ran = sum(c["prompt_mask"].numel() + c["completion_mask"].numel() for c in chunks)
    real = sum(int(c["prompt_mask"].sum() + c["completion_mask"].sum()) for c in chunks)
    return ran, real


def by_prefix(chunks: list[dict]) -> list[dict]:
    """The same episodes in as many micro-batches of the same sizes, those with the same prompt together (longest
    first within a prompt), each cut to its used columns."""
    def key(merged):
        prompts = [tuple(ids[m.bool()].tolist()) for ids, m in zip(merged["prompt_ids"], merged["prompt_mask"])]
        lengths = _lengths(merged)
        return lambda i: (prompts[i], -lengths[i])

    return _regroup(chunks, key)


def common_prefix(rows: list) -> int:
    """How many leading tokens every row (a 1-D tensor) shares."""
    import torch

    n = min(len(r) for r in rows)
    if n == 0 or len(rows) == 1:
        return n
    first = rows[0][:n]
    same = torch.stack([r[:n] == first for r in rows[1:]]).all(0)  # (n,)
    differ = (~same).nonzero()
    return int(differ[0]) if len(differ) else n


def shared_prefix_logps(model, input_ids, attention_mask, logits_to_keep: int, compute_entropy: bool = False,
                        min_shared: int | None = None):
    """(logps, entropies, saved): the completion tokens' log-probs and entropies as TRL's fused LM head gives them
    (`input_ids`: prompts left-padded, then `logits_to_keep` completion columns right-padded; (B, logits_to_keep)
    each, 0 at padding) with the rows' common prefix run once, and the tokens that spared ((B - 1) x the prefix).
    None when the rows share fewer than `min_shared` tokens (default: the engine's `MIN_SHARED_PREFIX`), a row's completion is not one block of tokens, or the
    model recomputes its layers in the backward (activation checkpointing keeps no cache): the caller runs its usual
    forward."""
    import torch
    from transformers.cache_utils import DynamicLayer

    from generator.engine import MIN_SHARED_PREFIX
    from generator.engine.cache import cache_keyword

    B, W = input_ids.shape
    P = W - logits_to_keep  # the prompt's padded width
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    checkpointed = getattr(base, "is_activation_checkpointing", None)
    if checkpointed is None:  # transformers < 5.24
        checkpointed = getattr(base, "is_gradient_checkpointing", False)
    if checkpointed and model.training and torch.is_grad_enabled():
        return None  # recomputed layers drop the cache, and the rows would not see the prefix
    prompt_lens = attention_mask[:, :P].sum(1).tolist()
    completion_mask = attention_mask[:, P:]
    completion_lens = completion_mask.sum(1).tolist()
    if B < 2 or any(int(completion_mask[b, :n].sum()) != n for b, n in enumerate(completion_lens)):
        return None
    rows = [torch.cat([input_ids[b, P - p:P], input_ids[b, P:P + c]])
            for b, (p, c) in enumerate(zip(prompt_lens, completion_lens))]
    # the prefix ends before each row's last prompt token, whose output scores the row's first completion token
    L = min(common_prefix(rows), min(prompt_lens) - 1)
    if L < (MIN_SHARED_PREFIX if min_shared is None else min_shared):
        return None
    S = max(len(r) for r in rows) - L
    suffix = torch.zeros(B, S, dtype=input_ids.dtype, device=input_ids.device)
    suffix_mask = torch.zeros(B, S, dtype=attention_mask.dtype, device=attention_mask.device)
    labels = torch.full((B, S), -100, dtype=input_ids.dtype, device=input_ids.device)  # pre-shifted: t scores t + 1
    for b, (r, p) in enumerate(zip(rows, prompt_lens)):
        n = len(r) - L
        suffix[b, :n], suffix_mask[b, :n] = r[L:], 1
        labels[b, p - 1 - L:n - 1] = r[p:]  # the completion tokens, each at the position that predicts it
    head = model(input_ids=rows[0][None, :L], use_cache=True, logits_to_keep=1)
    cache = getattr(head, "cache", None) or head.past_key_values
    if cache is None or cache.get_seq_length() != L or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None  # recurrent or sliding-window layers keep other state than every prefix token's keys and values
    for layer in cache.layers:  # (1, H, L, D) -> (B, H, L, D), a view: the gradient of every row reaches the one copy
        layer.keys, layer.values = layer.keys.expand(B, -1, -1, -1), layer.values.expand(B, -1, -1, -1)
    full_mask = torch.cat([suffix_mask.new_ones(B, L), suffix_mask], 1)
    out = model(input_ids=suffix, attention_mask=full_mask, shift_labels=labels, fused_lm_head=True,
                **{cache_keyword(model): cache})
    logps = out.log_probs.new_zeros(B, logits_to_keep)
    entropies = out.log_probs.new_zeros(B, logits_to_keep) if compute_entropy else None
    for b, (p, c) in enumerate(zip(prompt_lens, completion_lens)):
        logps[b, :c] = out.log_probs[b, p - 1 - L:p - 1 - L + c]
        if compute_entropy:
            entropies[b, :c] = out.entropy[b, p - 1 - L:p - 1 - L + c]
    return logps, entropies, (B - 1) * L
