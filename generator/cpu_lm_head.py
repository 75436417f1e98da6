"""Leaner CPU tiles for TRL's chunked LM head (`trl.kernels.chunked_logprob`), the same values to the bit.

Without Triton, TRL folds each (tokens x 32k) tile of logits with torch ops written as its Triton kernels are: a
multiply by the logit scale and one by 1 / T even when both are 1, a zero tensor the gradient is added into, a
one-hot compare of the whole tile in fp32. On a CPU each is a pass over ~100 MB. Measured here (2-core AMD EPYC,
800 tokens, SmolLM2's 49k vocabulary): the head's forward and backward took 1.68 s, of which the tiles' element-wise
passes ~0.85 s, against 0.25 s for its bf16 products and 0.25 s for its fp32 gradient products.

`lean_cpu_tiles` replaces TRL's two CPU tile functions with ones that skip the multiplies by 1, work in place, and
write the target column's gradient directly. Every value is the one TRL's tile computes (the same float operations
on the same operands: `0 - p`, `g * (1 - p)`, the sums by the same reductions); the tests compare both to the bit.
The rest of TRL's head (its chunking, its fp32 accumulation of the gradient products, the Triton path) is untouched.
Cases the lean tiles do not cover (soft-capped logits, the optional outputs other than entropy, an entropy
gradient) go to TRL's own."""

from __future__ import annotations

import inspect
import os

_FORWARD_ARGS = ("tile", "tile_stride", "targets", "running_max", "sum_exp", "x_sum_exp", "sq_sum_exp", "z_sum",
                 "max_before_target", "target_logit", "vocab_start", "n_cols", "logit_scale", "softcap", "inv_t",
                 "HAS_SOFTCAP", "HAS_ENTROPY", "HAS_LOG_SUM_SQ_PROBS", "HAS_MEAN_LOGITS", "HAS_IS_TOP1", "BLOCK_SIZE")
_BACKWARD_ARGS = ("tile", "tile_stride", "targets", "log_z", "entropy", "grad_logprobs", "grad_entropy", "vocab_start",
                  "n_cols", "logit_scale", "softcap", "inv_t", "HAS_SOFTCAP", "HAS_LOGPROB_GRAD", "HAS_ENTROPY_GRAD",
                  "BLOCK_SIZE")


def _scaled(tile, logit_scale, inv_t):
    """tile.float() * logit_scale * inv_t as TRL computes it, without the multiplies by 1 (x * 1.0 is x)."""
    z = tile.float()
    if logit_scale != 1:
        z.mul_(logit_scale)
    if inv_t != 1:
        z.mul_(inv_t)
    return z


def _in_tile(targets, vocab_start, n_cols):
    local = targets - vocab_start
    return local.clamp(0, n_cols - 1), (local >= 0) & (local < n_cols)


def _make_forward(original):
    import torch

    def forward_tile(tile, tile_stride, targets, running_max, sum_exp, x_sum_exp, sq_sum_exp, z_sum,
                     max_before_target, target_logit, vocab_start, n_cols, logit_scale, softcap, inv_t, HAS_SOFTCAP,
                     HAS_ENTROPY, HAS_LOG_SUM_SQ_PROBS, HAS_MEAN_LOGITS, HAS_IS_TOP1, BLOCK_SIZE):
        if tile.device.type != "cpu" or HAS_SOFTCAP or HAS_LOG_SUM_SQ_PROBS or HAS_MEAN_LOGITS or HAS_IS_TOP1:
            return original(tile, tile_stride, targets, running_max, sum_exp, x_sum_exp, sq_sum_exp, z_sum,
                            max_before_target, target_logit, vocab_start, n_cols, logit_scale, softcap, inv_t,
                            HAS_SOFTCAP, HAS_ENTROPY, HAS_LOG_SUM_SQ_PROBS, HAS_MEAN_LOGITS, HAS_IS_TOP1, BLOCK_SIZE)
        z = _scaled(tile, logit_scale, inv_t)  # (n, c) fp32
        local, hit = _in_tile(targets, vocab_start, n_cols)
        target_logit.copy_(torch.where(hit, z.gather(-1, local[:, None]).squeeze(-1), target_logit))
        new_m = torch.maximum(running_max, z.amax(-1))
        rescale = torch.exp(running_max - new_m)
        if HAS_ENTROPY:
            e = torch.exp(z - new_m[:, None])
            x_sum_exp.mul_(rescale).add_((e * z).sum(-1))
        else:
            e = z.sub_(new_m[:, None]).exp_()  # z is not needed after this
        sum_exp.mul_(rescale).add_(e.sum(-1))
        running_max.copy_(new_m)

    return forward_tile


def _make_backward(original):
    import torch

    def backward_tile(tile, tile_stride, targets, log_z, entropy, grad_logprobs, grad_entropy, vocab_start, n_cols,
                      logit_scale, softcap, inv_t, HAS_SOFTCAP, HAS_LOGPROB_GRAD, HAS_ENTROPY_GRAD, BLOCK_SIZE):
        if tile.device.type != "cpu" or HAS_SOFTCAP or HAS_ENTROPY_GRAD or not HAS_LOGPROB_GRAD:
            return original(tile, tile_stride, targets, log_z, entropy, grad_logprobs, grad_entropy, vocab_start,
                            n_cols, logit_scale, softcap, inv_t, HAS_SOFTCAP, HAS_LOGPROB_GRAD, HAS_ENTROPY_GRAD,
                            BLOCK_SIZE)
        p = _scaled(tile, logit_scale, inv_t).sub_(log_z[:, None]).exp_()  # (n, c) probabilities
        local, hit = _in_tile(targets, vocab_start, n_cols)
        rows = hit.nonzero().squeeze(-1)
        p_target = p[rows, local[rows]]  # before p becomes the gradient
        grad = p.mul_(grad_logprobs[:, None]).neg_()  # TRL: g * (0 - p), which is -(g * p) exactly
        grad[rows, local[rows]] = grad_logprobs[rows] * (1 - p_target)  # TRL: g * (1 - p) at the target
        if inv_t != 1:
            grad.mul_(inv_t)
        if logit_scale != 1:
            grad.mul_(logit_scale)
        tile.copy_(grad)

    return backward_tile


def lean_cpu_tiles() -> bool:
    """Swap TRL's CPU tile functions for the lean ones (process-wide, idempotent). False, and TRL left alone, when
    this TRL has no such functions or they take other arguments than the ones these were written against, or when
    `MIMESIS_LEAN_LM_HEAD=0` (TRL's own tiles: the benchmarks' path before)."""
    if os.environ.get("MIMESIS_LEAN_LM_HEAD") == "0":
        return False
    try:
        import trl.kernels.chunked_logprob as ck
    except ImportError:
        return False
    fwd, bwd = getattr(ck, "_forward_tile", None), getattr(ck, "_backward_tile", None)
    if fwd is None or bwd is None:
        return False
    if getattr(fwd, "_lean", False) and getattr(bwd, "_lean", False):
        return True
    if tuple(inspect.signature(fwd).parameters) != _FORWARD_ARGS or \
            tuple(inspect.signature(bwd).parameters) != _BACKWARD_ARGS:
        return False
    new_fwd, new_bwd = _make_forward(fwd), _make_backward(bwd)
    new_fwd._lean = new_bwd._lean = True
    new_fwd._trl, new_bwd._trl = fwd, bwd
    ck._forward_tile, ck._backward_tile = new_fwd, new_bwd
    return True
