"""The GRPO loss's micro-batches by length, each cut to its own width.

TRL pads a step's whole generation batch (8 episodes of 300-1,500 tokens here) to its longest episode, shuffles it
and slices it into micro-batches, so the loss's forward and backward run over every micro-batch at the full width.
`by_length` regroups the same episodes longest first, so each micro-batch holds episodes of like length, and cuts
each to the columns it uses: the prompt's left padding and the completion's right padding that no row needs.

The gradient is the same. TRL's token-level losses (dapo, the default, dr_grpo, grpo) sum over tokens and normalise
by counts that do not depend on how the episodes are grouped ("bnpo" normalises per micro-batch, and would change);
the rows' positions shift by the columns cut, and rotary attention depends only on position differences.
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


def by_length(chunks: list[dict]) -> list[dict]:
    """The same episodes in as many micro-batches of the same sizes, longest first, each cut to its used columns."""
    import torch
    from trl.trainer.utils import split_tensor_dict

    if not chunks:
        return chunks
    merged = _merge(chunks)
    lengths = merged["prompt_mask"].sum(1) + merged["completion_mask"].sum(1)  # (B,)
    order = torch.argsort(lengths, descending=True, stable=True)
    ordered = {key: value[order] if isinstance(value, torch.Tensor) and value.ndim > 0
               else [value[int(i)] for i in order] if isinstance(value, list) else value
               for key, value in merged.items()}
    return [_cut(part) for part in split_tensor_dict(ordered, len(chunks))]


def padded_tokens(chunks: list[dict]) -> tuple[int, int]:
    """(tokens the loss runs over, tokens that are real) for these micro-batches: the padding's share is 1 - b / a."""
    ran = sum(c["prompt_mask"].numel() + c["completion_mask"].numel() for c in chunks)
    real = sum(int(c["prompt_mask"].sum() + c["completion_mask"].sum()) for c in chunks)
    return ran, real
