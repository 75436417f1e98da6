"""What the distillation objectives (`dpg`, `bond`: adversary/objectives/) share: the calibrated density ratio of a
round, sequence log-probabilities of turns under the policy and under the warm start, and the weighted-likelihood
step that carries per-turn coefficients into the LoRA adapter.

Every distillation objective is the same update with other coefficients: for the turns x_i of a round (own samples
and the contexts' real turns), minimise  -sum_i c_i log pi(x_i) / (tokens in the batch).  c = 1 on every turn is
SFT; own samples with c_i = K w_i - 1 (w: self-normalised weights over a context's K samples) is a policy gradient
whose baseline is the uniform weight (the expected gradient of log pi over own samples is 0, so the unweighted part
of the sum carries nothing but noise). TRL has no trainer for per-turn coefficients, so the step is a small torch
loop over peft's adapter with the run's precision.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from adversary.objectives.base import RoundsObjective
from conversations.schema import TurnRecord


@dataclass
class WeightedTurn:
    record: TurnRecord  # context and the turn (record.user_turn, record.is_last: its end marker)
    coef: float  # c_i of the loss


def calibrate_round(real_scores: np.ndarray, sample_scores: np.ndarray):
    """A Platt scaler of the discriminator's log-odds fitted on the round's fresh pairs (each context's real turn
    against its first own sample), which the discriminator has not been trained on yet (the co-training comes
    after): the round's D/(1-D) read as a density ratio. -> (scaler, {"round/calib_a", "round/calib_b",
    "round/calib_ece_raw", "round/calib_ece"})."""
    from discriminator.calibration import PlattScaler, calibration_report

    raw = np.concatenate([np.asarray(real_scores, dtype=np.float64), np.asarray(sample_scores, dtype=np.float64)])
    y = np.asarray([1] * len(real_scores) + [0] * len(sample_scores))
    scaler = PlattScaler().fit(raw, y) if len(set(y)) == 2 and np.ptp(raw) > 0 else PlattScaler()
    rep = calibration_report(raw, y, scaler)
    return scaler, {"round/calib_a": scaler.a, "round/calib_b": scaler.b, "round/calib_ece_raw": rep["raw"]["ece"],
                    "round/calib_ece": rep["calibrated"]["ece"]}


def group_weights(logw: np.ndarray) -> np.ndarray:
    """Self-normalised weights per row: (n, K) log-weights (-inf: never kept) -> (n, K) rows summing to 1 (a row of
    -inf only: zeros)."""
    z = np.asarray(logw, dtype=np.float64)
    top = np.max(np.where(np.isfinite(z), z, -np.inf), axis=1, keepdims=True)
    w = np.where(np.isfinite(z), np.exp(z - np.where(np.isfinite(top), top, 0.0)), 0.0)
    s = w.sum(1, keepdims=True)
    return np.divide(w, s, out=np.zeros_like(w), where=s > 0)


def _encode(tokenizer, records, max_context_tokens: int, max_length: int):
    from generator.sft_examples import encode_example, sft_example

    rows = []
    for r in records:
        ids, mask = encode_example(tokenizer, sft_example(r, tokenizer, max_context_tokens=max_context_tokens,
                                                          max_length=max_length))
        rows.append((ids[:max_length], mask[:max_length]))
    return rows


def _batch(rows, pad_id: int, device):
    import torch

    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(rows), width), dtype=torch.long)
    lab = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (x, m) in enumerate(rows):
        ids[i, :len(x)] = torch.tensor(x)
        att[i, :len(x)] = 1
        lab[i, :len(m)] = torch.tensor(m, dtype=torch.bool)
    return ids.to(device), att.to(device), lab.to(device)


def _token_logprobs(model, ids, att, lab):
    """log pi of every completion token: (N,) over the batch's completion positions, and (B,) the row of each. The LM
    head runs on the completion positions only ((N, V), not (B, T, V))."""
    import torch

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = inner.model(input_ids=ids, attention_mask=att).last_hidden_state  # (B, T, H)
    target = lab[:, 1:]  # (B, T-1): position t predicts token t+1
    h = hidden[:, :-1][target]  # (N, H)
    logits = inner.lm_head(h).float()  # (N, V)
    tok = ids[:, 1:][target]
    logp = -torch.nn.functional.cross_entropy(logits, tok, reduction="none")  # (N,)
    rows = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(target)[target]  # (N,)
    return logp, rows


def sequence_logprobs(model, tokenizer, records, *, precision: str, max_context_tokens: int, max_length: int,
                      batch_size: int = 16, reference: bool = False) -> np.ndarray:
    """(n,) summed log-probability of each record's turn (its end marker and end-of-turn included) given its context,
    under the model (`reference`: under the model with its LoRA adapter switched off: the warm start). No gradient."""
    import contextlib

    import torch

    from conversations.precision import autocast

    device = next(model.parameters()).device
    rows = _encode(tokenizer, records, max_context_tokens, max_length)
    out = np.zeros(len(rows))
    ref = model.disable_adapter() if reference else contextlib.nullcontext()
    was_training = model.training
    model.eval()
    with ref, torch.no_grad(), autocast(precision, device):
        for s in range(0, len(rows), batch_size):
            ids, att, lab = _batch(rows[s:s + batch_size], tokenizer.pad_token_id, device)
            logp, which = _token_logprobs(model, ids, att, lab)
            out[s:s + len(ids)] = torch.zeros(len(ids), device=device).index_add_(0, which, logp).cpu().numpy()
    model.train(was_training)
    return out


def weighted_steps(model, tokenizer, turns: list[WeightedTurn], *, lr: float, batch_size: int, micro_batch: int,
                   precision: str, max_context_tokens: int, max_length: int, epochs: int = 1, seed: int = 0,
                   seconds_left: float | None = None, optimizer=None):
    """Optimiser steps of -sum_i c_i log pi(x_i) / (completion tokens of the step) over `turns` (shuffled, `epochs`
    passes) on the model's trainable (LoRA) parameters; stops early when `seconds_left` runs out.
    -> (steps, mean loss or None, the optimizer: pass it back to keep AdamW's moments across rounds)."""
    import torch

    from conversations.precision import autocast

    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer or torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    rows = _encode(tokenizer, [t.record for t in turns], max_context_tokens, max_length)
    coef = np.asarray([t.coef for t in turns], dtype=np.float64)
    rng = np.random.default_rng(seed)
    t0, steps, losses = time.time(), 0, []
    model.train()
    for _ in range(epochs):
        order = rng.permutation(len(rows))
        for s in range(0, len(order) - batch_size + 1 if len(order) >= batch_size else 1, batch_size):
            if seconds_left is not None and time.time() - t0 > seconds_left:
                return steps, (float(np.mean(losses)) if losses else None), opt
            idx = order[s:s + batch_size]
            n_tok = sum(sum(rows[i][1]) for i in idx) or 1  # completion tokens of the step (each one predicted)
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for m in range(0, len(idx), micro_batch):
                part = idx[m:m + micro_batch]
                ids, att, lab = _batch([rows[i] for i in part], tokenizer.pad_token_id, device)
                with autocast(precision, device):
                    logp, which = _token_logprobs(model, ids, att, lab)
                c = torch.as_tensor(coef[part], dtype=torch.float32, device=device)[which]  # (N,)
                loss = -(c * logp).sum() / n_tok
                loss.backward()
                total += float(loss.detach())
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            steps += 1
            losses.append(total)
    return steps, (float(np.mean(losses)) if losses else None), opt


# ------------------------------------------------------------------------------------------ the rounds they share


class DistillRounds(RoundsObjective):
    """One round of a distillation objective: `round_contexts` contexts, `distill_candidates` own samples each at
    T 1 and top-p `distill_top_p` (1: the policy's own distribution), scored by the discriminator and Platt-scaled
    on the round's fresh pairs; `coefficients` (the subclass) turns the calibrated log-odds into per-sample c_i;
    the contexts' real turns join with c = `distill_real_weight`; `distill_epochs` of the weighted step; then
    the discriminator is co-trained on one unbiased sample per context, so the next round reweights by a refit D."""

    owns = ("round_contexts", "max_rounds", "eval_rounds", "distill_candidates", "distill_lr",
            "distill_real_weight", "distill_weight", "distill_epochs", "distill_top_p")

    def __init__(self, phase):
        super().__init__(phase)
        self.optimizer = None  # AdamW's moments kept across rounds (a resume starts them afresh)

    def coefficients(self, z: np.ndarray, usable: np.ndarray, contexts, samples) -> tuple[np.ndarray, dict]:
        """(n_ctx, K) c_i of the own samples from the calibrated log-odds z (n_ctx, K) and which samples are
        usable (not empty, not cut by the budget); and the subclass's figures."""
        raise NotImplementedError

    def train_round(self, k: int, step: int) -> dict:
        from conversations.memory import release_memory
        from conversations.seeds import derive_seed

        ph, cfg = self.phase, self.phase.cfg
        K = cfg.distill_candidates
        contexts, samples, raw = self.sample_round(k, K, temperature=1.0, top_p=cfg.distill_top_p)
        scaler, fig = calibrate_round(self.real_scores(contexts), raw[:, 0])
        z = scaler(raw)  # (n_ctx, K) calibrated log-odds: log D/(1-D)
        usable = np.asarray([[bool(t.text) and not t.truncated for t in ts] for ts in samples])  # (n_ctx, K)
        coef, own = self.coefficients(z, usable, contexts, samples)
        coef = cfg.distill_weight * coef
        turns = [WeightedTurn(TurnRecord(id=f"{c.id}@own{j}", context=c.context, user_turn=t.text or "...",
                                         is_last=t.ended), float(coef[i, j]))
                 for i, (c, ts) in enumerate(zip(contexts, samples)) for j, t in enumerate(ts)
                 if abs(coef[i, j]) > 1e-6]
        if cfg.distill_real_weight > 0:
            turns += [WeightedTurn(c, cfg.distill_real_weight) for c in contexts]
        steps, loss, self.optimizer = weighted_steps(
            ph.model, ph.tokenizer, turns, lr=cfg.distill_lr, batch_size=cfg.warmstart_batch_size,
            micro_batch=cfg.warmstart_micro_batch, precision=cfg.dtype, max_context_tokens=cfg.max_context_tokens,
            max_length=cfg.warmstart_max_length, epochs=cfg.distill_epochs,
            seed=derive_seed(ph.args.seed, step=k, stream=3), seconds_left=ph.seconds_left(),
            optimizer=self.optimizer)
        release_memory()
        fig.update({"round/steps": steps, "round/loss": loss, "round/turns": len(turns),
                    "round/score_mean": float(np.mean(z)), "round/usable": float(np.mean(usable)), **own,
                    **self.sampling_figures(samples)})
        fig.update(self.cotrain(contexts, samples, step + steps))
        return fig

    def summary(self, fig: dict) -> str:
        loss = f"{fig['round/loss']:.3f}" if fig.get("round/loss") is not None else "-"
        ess = f", ESS {fig['round/ess_mean']:.2f}" if fig.get("round/ess_mean") is not None else ""
        return (f"{fig['round/turns']} weighted turns, {fig['round/steps']} steps (loss {loss}){ess}, Platt a "
                f"{fig['round/calib_a']:.2f}, discriminator acc on fresh {fig['disc/acc']:.3f}")
