"""The end decision read from the simulator itself: P(end | context, turn) from one teacher-forced forward.

The simulator ends a conversation by writing END_SEPARATOR + END_MARKER after its turn's text (the SFT target of a
conversation's last turn, `generator.prompts.target_text`). Sampled token by token under a nucleus, that minority
continuation ended the default run's conversations 7-22% as often as real users did inside the meter's window. `end_probabilities` reads the model's estimate directly,

    p_end = P(sep + marker + eos | prompt, text) / (P(sep + marker + eos | prompt, text) + P(eos | prompt, text)),

the two ways a turn with this text can finish, renormalised (one forward over prompt + text + sep + marker + eos per
turn, batched). `decide_ends` draws the decision from it with a logit offset (`end_bias`, solved by `solve_end_bias`
on train contexts), so the decision is calibrated without touching how the text is sampled.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from generator.prompts import END_MARKER, END_SEPARATOR


def end_probabilities(engine, prompts: Sequence[str], texts: Sequence[str], *, batch_size: int = 8) -> np.ndarray:
    """p_end (see the module docstring) for each (rendered prompt, turn text) on `engine`'s model, shape (N,): the
    engine's precision rule, and only the logits the decision reads. The text is the turn without its marker.
    Batches of 8 and no KV cache: on 64 turns of SmolLM2-135M, batches of 32 raised the process's peak by 1.4 GB
    (the default run's peak, set in its first reading's offset solve) and batches of 8 by 0.4 GB, in 11.5 s
    against 13.4 s (2 CPU cores)."""
    import torch

    model, tokenizer = engine.model, engine.tokenizer
    eos = tokenizer.eos_token_id
    suffix = tokenizer(END_SEPARATOR + END_MARKER, add_special_tokens=False)["input_ids"] + [eos]
    rows = [tokenizer(p, add_special_tokens=False)["input_ids"] + tokenizer(t, add_special_tokens=False)["input_ids"]
            + suffix for p, t in zip(prompts, texts)]
    device = next(model.parameters()).device
    out = np.zeros(len(rows))
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    keep = len(suffix) + 1  # left padding: every row's suffix, and the position before it, are its last columns
    suffix_ids = torch.tensor(suffix, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), engine._autocast(device):
            for s in range(0, len(order), batch_size):
                idx = order[s: s + batch_size]
                width = max(len(rows[i]) for i in idx)
                ids = torch.full((len(idx), width), engine.pad_id, dtype=torch.long)
                mask = torch.zeros((len(idx), width), dtype=torch.long)
                for j, i in enumerate(idx):
                    ids[j, width - len(rows[i]):] = torch.tensor(rows[i])
                    mask[j, width - len(rows[i]):] = 1
                # the kept positions as an index tensor, not a count: a count slices the hidden states into a
                # non-contiguous (B, keep, H) view, which torch's CPU matmul multiplies by a batch-expanded copy of
                # the output head (2.1x the head's time at Gemma 3's 262k vocabulary, 1.9x at SmolLM2's 49k)
                kw = {"logits_to_keep": torch.arange(width - keep, width)} if engine._keep_kw else {}
                kw["use_cache"] = False  # one forward: a cache would only hold every layer's keys and values
                logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), **kw).logits[:, -keep:]
                logp = torch.log_softmax(logits.float(), -1)  # (B, keep, V): only the positions the decision reads
                lp_end = logp[:, :-1].gather(-1, suffix_ids.expand(len(idx), -1).unsqueeze(-1)).squeeze(-1).sum(-1)
                out[idx] = torch.sigmoid(lp_end - logp[:, 0, eos]).cpu().numpy()
    finally:
        model.train(was_training)
    return out


def end_decisions(engine, prompts: Sequence[str], texts: Sequence[str], end_bias: float, seed: int) -> list[bool]:
    """The end decision of each sampled turn (rendered prompt, text without its marker) on `engine`'s model: drawn at
    logit(p_end) + `end_bias`; an empty turn never ends. Every caller with `SamplingSettings.end_bias` set comes here."""
    p_end = end_probabilities(engine, prompts, texts)
    return [bool(e and t) for e, t in zip(decide_ends(p_end, end_bias, seed), texts)]


def decide_ends(p_end: np.ndarray, end_bias: float, seed: int) -> np.ndarray:
    """Bernoulli draws of the end decision at logit(p_end) + end_bias, shape (N,) bool; the same seed, the same
    draws."""
    q = _sigmoid(_logit(p_end) + end_bias)
    return np.random.default_rng(seed).random(len(q)) < q


def solve_end_bias(p_end: np.ndarray, target_rate: float) -> float:
    """The logit offset at which the mean end probability of `p_end` (the simulator's own turns) is `target_rate`
    (bisection: the mean is increasing in the offset), clipped to [-20, 20]."""
    if not 0 < target_rate < 1:
        raise ValueError(f"target_rate must be in (0, 1), got {target_rate}")
    logit = _logit(p_end)
    lo, hi = -20.0, 20.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if np.mean(_sigmoid(logit + mid)) < target_rate:
            lo = mid
        else:
            hi = mid
    return round((lo + hi) / 2, 4)


def _logit(p) -> np.ndarray:
    p = np.clip(np.asarray(p, dtype=float), 1e-9, 1 - 1e-9)
    return np.log(p / (1 - p))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def window_end_rate(convs, seed_user_turns: int, max_turns: int) -> float:
    """Real users' end rate per user turn inside a window of `max_turns` turns after `seed_user_turns` opening ones:
    the ends inside the window over the turns inside it, over conversations with a turn after the opening (the
    conversation meter's population)."""
    ends = turns = 0
    for c in convs:
        body = [m for m in c.messages if m["role"] != "system"]
        if not body or body[0]["role"] != "user":
            continue
        after = sum(m["role"] == "user" for m in body) - seed_user_turns
        if after < 1:
            continue
        turns += min(after, max_turns)
        ends += after <= max_turns
    if not turns:
        raise ValueError("no conversation has a user turn after the opening")
    return ends / turns
